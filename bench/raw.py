"""The raw model ceiling: the model called in-process (no queue, no HTTP) at batch sizes
1, 2, 4, … max_batch_size. Run in a process of its own:

    python -m bench.raw --models-file bench/results/models.yaml --model minilm-embed
"""
from __future__ import annotations

import argparse
import json
import time

from bench.load import make_inputs
from config import load_models
from workers.handlers import build_handler


def measure(models_file: str, model: str, seconds: float) -> dict:
    spec = load_models(models_file)[model]
    handler = build_handler(spec, "cpu")
    handler.initialize()
    handler.warmup()
    kind = "tensor" if spec.kind == "torchscript" else "text"
    sizes, size = [], 1
    while size < spec.max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(spec.max_batch_size)
    rows = []
    for size in sizes:
        items = make_inputs(kind, size, seed=7)
        calls, started = 0, time.perf_counter()
        while True:
            handler.predict(items)
            calls += 1
            elapsed = time.perf_counter() - started
            if elapsed >= seconds and calls >= 3:
                break
        rows.append({"batch_size": size, "call_ms": 1000 * elapsed / calls,
                     "items_per_s": size * calls / elapsed})
    return {"model": model, "batches": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models-file", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seconds", type=float, default=2.0)
    a = p.parse_args()
    print(json.dumps(measure(a.models_file, a.model, a.seconds)))


if __name__ == "__main__":
    main()
