"""How many torch threads a model on the CPU should have when other processes share the host:
every usable core but one (workers/child/devices.py `cores_less_one`) against torch's own default
(every usable core), side by side in one process, on an idle host and with other work beside
it. The service's default is torch's; IQ_CPU_THREADS sets another.

    python -m bench.threads [--model minilm-embed --seconds 60 --busy 1]

The model is loaded once (as a pool child loads it); each round times one call per batch
size at each thread count in turn, so both counts see the same moments of the machine. Half
the rounds run with `--busy` processes spinning beside it, each a pure-Python loop with one
core's worth of appetite: the worker's main process, the API and Redis under load. Writes
bench/results/threads.json and threads.png: per batch size and condition, p50 / p90 / p99 ms
of a call, and the ratio of torch's default to cores less one (above 1: fewer is faster).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

from bench.load import make_inputs
from config import Settings, load_models
from workers.child.devices import cores_less_one, usable_cpus
from workers.child.runtime import load_handler

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (1, 16, 32)


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(model: str, seconds: float, busy: int) -> dict:
    import torch

    settings = Settings()
    spec = load_models(settings.models_file)[model]
    handler = load_handler(spec, "cpu", settings)
    cpus = usable_cpus()
    counts = {"cores less one": cores_less_one(cpus), "torch default": cpus}
    times = {(cond, name, size): [] for cond in ("idle", "busy") for name in counts
             for size in SIZES}
    seed = 0
    for cond in ("idle", "busy"):
        stop = multiprocessing.Event()
        spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
                    for _ in range(busy if cond == "busy" else 0)]
        for proc in spinners:
            proc.start()
        end = time.monotonic() + seconds / 2
        while True:  # each cell timed at least once
            for name, threads in counts.items():
                torch.set_num_threads(threads)
                for size in SIZES:
                    items = make_inputs(spec.kind, size, seed)
                    seed += 1
                    started = time.perf_counter()
                    handler.predict(items)
                    times[(cond, name, size)].append((time.perf_counter() - started) * 1000)
            if time.monotonic() >= end:
                break
        stop.set()
        for proc in spinners:
            proc.join()
    rows = []
    for (cond, name, size), ms in times.items():
        rows.append({"condition": cond, "threads": counts[name], "config": name,
                     "batch_size": size, "calls": len(ms), "p50_ms": round(quantile(ms, .5), 1),
                     "p90_ms": round(quantile(ms, .9), 1), "p99_ms": round(quantile(ms, .99), 1)})
    ratios = {f"{cond} batch {size}": round(
        quantile(times[(cond, "torch default", size)], .5)
        / quantile(times[(cond, "cores less one", size)], .5), 2)
        for cond in ("idle", "busy") for size in SIZES}
    return {"model": model, "usable_cpus": cpus, "busy_processes": busy,
            "threads": counts, "load_before": os.getloadavg(), "rows": rows,
            "p50_default_over_cores_less_one": ratios}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, cond in zip(axes, ("idle", "busy")):
        for name in result["threads"]:
            rows = [r for r in result["rows"] if r["condition"] == cond and r["config"] == name]
            ax.errorbar([r["batch_size"] for r in rows], [r["p50_ms"] for r in rows],
                        yerr=[[0] * len(rows), [r["p90_ms"] - r["p50_ms"] for r in rows]],
                        marker="o", capsize=3,
                        label=f"{name} ({result['threads'][name]} thread(s))")
        ax.set_title(f"{cond} host" + (f" ({result['busy_processes']} busy process(es))"
                                       if cond == "busy" else ""))
        ax.set_xlabel("batch size (items)")
        ax.legend()
    axes[0].set_ylabel("ms per call (p50, bar to p90)")
    fig.suptitle(f"{result['model']} on {result['usable_cpus']} CPU cores: torch threads")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.threads",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="minilm-embed")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--busy", type=int, default=1,
                        help="processes spinning beside the model in the busy half")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result = measure(args.model, args.seconds, args.busy)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "threads.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "threads.png")
    print(json.dumps(result["p50_default_over_cores_less_one"], indent=1))


if __name__ == "__main__":
    main()
