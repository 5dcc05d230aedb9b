"""INT8 against FP32 on this machine's CPU, side by side: `python -m bench.quantised`.

The same MiniLM folder loaded twice, each in a process of its own (bench/raw.py --serve):
`dtype: float32` and `dtype: int8` (dynamic quantisation of the linear layers). Memory is each
process's resident set once its model is loaded and warmed up (both processes import the
same libraries, so the difference is the model's). Speed is measured in rounds that take the
two in turn, at batch 1 and at max_batch_size, so that both see the same machine. Writes
bench/results/int8.json and prints the table bench/README.md shows.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import psutil
import yaml

from bench.harness import MODELS, RESULTS, RawServer, pool_raw

DTYPES = ("float32", "int8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="per model, size and round")
    p.add_argument("--out", default=str(RESULTS / "int8.json"))
    a = p.parse_args()
    package = MODELS["minilm-embed"]["package"]  # the folder the service's minilm-embed loads
    models = {f"minilm-{d}": {"kind": "embedding", "package": package, "dtype": d,
                              "device": "cpu", "max_batch_size": 32} for d in DTYPES}
    models_file = Path(tempfile.mkdtemp(prefix="iq-int8-")) / "models.yaml"
    models_file.write_text(yaml.safe_dump({"models": models}))
    servers = {d: RawServer(models_file, f"minilm-{d}") for d in DTYPES}
    try:
        rss = {d: psutil.Process(s.proc.pid).memory_info().rss for d, s in servers.items()}
        rounds: dict[tuple[str, int], list[dict]] = {}
        for r in range(a.rounds):
            order = DTYPES if r % 2 == 0 else DTYPES[::-1]
            for size in (1, 32):
                for d in order:
                    rounds.setdefault((d, size), []).append(
                        servers[d].measure(size, a.seconds))
    finally:
        for s in servers.values():
            s.close()
    result = {d: {"rss_mb": round(rss[d] / 2**20, 1),
                  "weights_mb": round(servers[d].weight_bytes / 2**20, 1),
                  "batches": [pool_raw(rounds[(d, size)]) for size in (1, 32)]}
              for d in DTYPES}
    Path(a.out).write_text(json.dumps(result, indent=2))
    print("| dtype | weights (MB) | process RSS (MB) | batch 1 (ms) | batch 32 (items/s) |")
    print("|---|---|---|---|---|")
    for d in DTYPES:
        one, full = result[d]["batches"]
        print(f"| {d} | {result[d]['weights_mb']:.0f} | {result[d]['rss_mb']:.0f} | {one['call_ms']:.1f} | "
              f"{full['items_per_s']:.0f} (rounds {full['rounds_items_per_s']}) |")


if __name__ == "__main__":
    main()
