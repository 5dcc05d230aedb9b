"""Device placement and GPU memory settings for one pool child.

Called only inside a pool child, after it started: the worker's parent process never imports
torch, so it never creates a CUDA context that a child could inherit.
"""
from __future__ import annotations

import os

from config import ConfigError, Settings


def configure_allocator(settings: Settings) -> None:
    """PYTORCH_CUDA_ALLOC_CONF is read when CUDA initialises: set it before torch is imported."""
    if settings.cuda_alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = settings.cuda_alloc_conf


def visible_gpu_count() -> int:
    """GPUs on this host, asked of nvidia-smi (another process) so that the caller never
    initialises CUDA; IQ_GPU_COUNT overrides."""
    if os.environ.get("IQ_GPU_COUNT"):
        return int(os.environ["IQ_GPU_COUNT"])
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def pick_device(policy: str, child_index: int) -> str:
    """`cuda:<child index mod device count>`, or `cpu` when there is no GPU (or policy says so)."""
    import torch

    if policy == "cpu":
        return "cpu"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        if policy == "cuda":
            raise ConfigError("device: cuda was asked for but no CUDA device is visible")
        return "cpu"
    return f"cuda:{child_index % count}"


def prepare_device(device: str, settings: Settings) -> None:
    import torch

    if settings.cpu_threads > 0:
        torch.set_num_threads(settings.cpu_threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        if settings.cuda_memory_fraction > 0:
            torch.cuda.set_per_process_memory_fraction(settings.cuda_memory_fraction, device)


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16}[name]
