"""The raw model ceiling: the model called in-process (no queue, no HTTP). Run in a process
of its own, either as a sweep over batch sizes 1, 2, 4, … max_batch_size:

    python -m bench.raw --models-file bench/results/models.yaml --model minilm-embed

or with `--serve`, loaded once and measuring on request: each line `<batch size> <seconds>`
on stdin is answered by one JSON line on stdout. The benchmark uses that to measure the
ceiling in the same rounds as the services, side by side.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from bench.load import make_inputs
from config import load_models
from workers.child.devices import device_for
from workers.child.handlers import build_handler


def weight_bytes(model: object) -> int:
    """Bytes of a model's weights as it holds them (int8 ones count one byte each)."""
    import torch

    def size(value: object) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (tuple, list)):
            return sum(size(v) for v in value)
        return 0

    state = model.state_dict() if hasattr(model, "state_dict") else {}
    return sum(size(v) for v in state.values())


def batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, … and max_batch_size itself."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch_size]


class RawModel:
    def __init__(self, models_file: str, model: str) -> None:
        self.spec = load_models(models_file)[model]
        # Where the service's worker puts it (device auto: the GPU where there is one), so
        # that a GPU run compares the service with the raw model on the same device.
        self.handler = build_handler(self.spec, device_for(self.spec, 0))
        self.handler.initialize()
        self.handler.warmup()
        self.kind = "tensor" if self.spec.kind == "torchscript" else "text"

    def measure(self, size: int, seconds: float) -> dict:
        items = make_inputs(self.kind, size, seed=7)
        calls, started = 0, time.perf_counter()
        while True:
            self.handler.predict(items)
            calls += 1
            elapsed = time.perf_counter() - started
            if elapsed >= seconds and calls >= 3:
                break
        return {"batch_size": size, "calls": calls, "seconds": elapsed,
                "call_ms": 1000 * elapsed / calls, "items_per_s": size * calls / elapsed}


def sweep(raw: RawModel, model: str, seconds: float) -> dict:
    return {"model": model, "batches": [raw.measure(size, seconds)
                                        for size in batch_sizes(raw.spec.max_batch_size)]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models-file", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--serve", action="store_true")
    a = p.parse_args()
    raw = RawModel(a.models_file, a.model)
    if not a.serve:
        print(json.dumps(sweep(raw, a.model, a.seconds)))
        return
    print(json.dumps({"ready": True, "max_batch_size": raw.spec.max_batch_size,
                      "weight_bytes": weight_bytes(getattr(raw.handler, "model", None))}),
          flush=True)
    for line in sys.stdin:
        size, seconds = line.split()
        print(json.dumps(raw.measure(int(size), float(seconds))), flush=True)


if __name__ == "__main__":
    main()
