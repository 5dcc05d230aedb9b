"""The GPU memory gauges are set in the pool child that holds the model
(workers/child/runtime.py `ModelRuntime.record_memory`), from torch's own figures for its CUDA
device; a model on the CPU, or one the child does not hold, sets none. Off a GPU, torch's two
calls are stood in for here (`make gpu-check` reads the gauges on a real one)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from prometheus_client import REGISTRY

from workers.child.runtime import ModelRuntime


def test_a_cuda_models_gauges_come_from_torch_and_a_cpu_models_from_nowhere(monkeypatch):
    monkeypatch.setattr(torch.cuda, "memory_allocated", {"cuda:1": 123}.__getitem__)
    monkeypatch.setattr(torch.cuda, "memory_reserved", {"cuda:1": 456}.__getitem__)
    child = SimpleNamespace(handlers={
        "on-gpu": SimpleNamespace(device="cuda:1", runs_torch=True),
        "on-cpu": SimpleNamespace(device="cpu", runs_torch=True),
        # The stand-in runs no torch: its child holds nothing on its device to report.
        "stand-in": SimpleNamespace(device="cuda:2", runs_torch=False)})
    for model in ("on-gpu", "on-cpu", "stand-in", "not-held"):
        ModelRuntime.record_memory(child, model)  # type: ignore[arg-type]

    def sample(name: str, device: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"device": device})

    assert sample("iq_gpu_memory_allocated_bytes", "cuda:1") == 123
    assert sample("iq_gpu_memory_reserved_bytes", "cuda:1") == 456
    assert sample("iq_gpu_memory_allocated_bytes", "cpu") is None
    assert sample("iq_gpu_memory_allocated_bytes", "cuda:2") is None
