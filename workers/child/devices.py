"""Device placement and GPU memory settings for one pool child.

Called only inside a pool child, after it started: the worker's parent process never imports
torch, so it never creates a CUDA context that a child could inherit.
"""
from __future__ import annotations

import logging
import os

from config import ConfigError, Settings
from config.models import ModelSpec

logger = logging.getLogger(__name__)
# Where a loaded GPU driver shows itself (NVIDIA's; WSL's; AMD's, for torch's ROCm builds):
# where none does, the stand-in is placed on the CPU without asking torch.
GPU_DRIVERS = ("/proc/driver/nvidia", "/dev/dxg", "/dev/kfd")


def configure_allocator(settings: Settings) -> None:
    """PYTORCH_CUDA_ALLOC_CONF is read when CUDA initialises: set it before torch is imported."""
    if settings.cuda_alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = settings.cuda_alloc_conf


def visible_gpu_count(settings: Settings) -> int:
    """GPUs on this host: settings.gpu_count (IQ_GPU_COUNT) when set, else asked of
    nvidia-smi, another process, so that the caller never initialises CUDA."""
    if settings.gpu_count >= 0:
        return settings.gpu_count
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def pool_children(settings: Settings) -> int:
    """The pool children a worker runs on this host: children_per_gpu per GPU; 0 on a host
    without one (the worker then runs one, or IQ_WORKER_CONCURRENCY)."""
    return visible_gpu_count(settings) * settings.children_per_gpu


def pick_device(policy: str, child_index: int, runs_torch: bool = True) -> str:
    """`cuda:<child index mod device count>` (children i, i + count, ... share device i), or
    `cpu` when there is no GPU (or policy says so). For a model that runs no torch
    (`runs_torch` False: the stand-in), on a host with no GPU driver loaded, torch is not
    asked: its child then never imports it."""
    if policy == "cpu":
        return "cpu"
    count = 0
    if runs_torch or any(os.path.exists(path) for path in GPU_DRIVERS):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        if policy == "cuda":
            raise ConfigError("device: cuda was asked for but no CUDA device is visible")
        return "cpu"
    return f"cuda:{child_index % count}"


def device_for(spec: ModelSpec, child_index: int, runs_torch: bool = True) -> str:
    # int8 weights run through torch's quantised CPU kernels (fbgemm/qnnpack), which have no
    # CUDA counterpart: such a model stays on the CPU even on a GPU host.
    if spec.dtype == "int8":
        return "cpu"
    try:
        return pick_device(spec.device, child_index, runs_torch)
    except ConfigError as exc:  # the model and its field named, as the reload's check does
        raise ConfigError(f"models.{spec.name}.device: {spec.device!r}: {exc}") from None


def usable_cpus() -> int:
    """Cores this process may run on (its affinity, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cores_less_one(cpus: int) -> int:
    """The thread count bench/threads.py weighs against torch's default: every usable core
    but one (at least one), the one left for the processes beside the model."""
    return max(1, cpus - 1)


def prepare_device(device: str, settings: Settings, memory_fraction: float = 0.0) -> None:
    """`memory_fraction` (0: IQ_CUDA_MEMORY_FRACTION) caps what this process may allocate on
    the device: CUDA's caching allocator raises out-of-memory past it. IQ_CPU_THREADS (0:
    torch's default, every core) sets torch's intra-op threads. Fewer threads than cores cost
    throughput on an idle host and save latency on a busy one (bench/threads.py, bench/README
    "torch threads on the CPU"): on this 2-core machine one thread made minilm-embed's
    closed-loop throughput 18-37 % lower, so the default stays torch's."""
    import torch

    if settings.cpu_threads > 0:
        torch.set_num_threads(settings.cpu_threads)
    if device == "cpu":
        logger.info("torch runs on %d CPU thread(s) of %d usable core(s)",
                    torch.get_num_threads(), usable_cpus())
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        fraction = child_memory_fraction(memory_fraction, settings)
        if fraction > 0:
            torch.cuda.set_per_process_memory_fraction(fraction, device)


def child_memory_fraction(memory_fraction: float, settings: Settings) -> float:
    """This child's cap on its GPU (0: none): the models' fractions (else
    IQ_CUDA_MEMORY_FRACTION), shared by the device's children_per_gpu children."""
    return (min(memory_fraction, 1.0) or settings.cuda_memory_fraction) \
        / settings.children_per_gpu


def nvml_utilization(device: str) -> float | None:
    """NVML's utilisation of `device` (0-1), beside the busy share: the share of NVML's last
    sample period in which a kernel ran, whoever ran it. None where NVML cannot say (no
    NVIDIA driver, or an older one; pynvml is nvidia-ml-py, a worker requirement). In the pool
    child only, which holds the CUDA context: the device is found by its UUID, so
    CUDA_VISIBLE_DEVICES cannot mislead."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(
            uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        return pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
    except Exception:  # noqa: BLE001 (no pynvml, no NVML, an older driver: no figure)
        return None


def torch_dtype(name: str):
    """The dtype weights are loaded in; int8 models load in float32 and are quantised after."""
    import torch

    return {"float32": torch.float32, "float16": torch.float16,
            "bfloat16": torch.bfloat16, "int8": torch.float32}[name]


def place(model, device: str, dtype: str):
    """The model on its device in eval mode; for int8, its linear layers dynamically quantised
    (weights stored in int8, activations quantised per batch), which is where a transformer's
    time and memory go."""
    model = model.to(device).eval()
    if dtype != "int8":
        return model
    import warnings

    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    # torch.ao.quantization warns that it moves to torchao; in torch 2.13 it is still the
    # quantiser that ships with torch and runs on the CPU without another dependency.
    # Per-channel weight scales: per-tensor ones cost MiniLM's vectors a cosine of 0.87 to
    # the float32 ones on short texts, per-channel 0.92 (tests/unit/test_quantised.py).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        quantised = quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig},
                                     dtype=torch.qint8).eval()
    del model
    _release_freed_memory()
    return quantised


def _release_freed_memory() -> None:
    """Hand the float32 weights that quantisation replaced back to the system: glibc keeps
    freed heap memory in the process unless asked (elsewhere this does nothing)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    # scripts/worker.sh: children_per_gpu pool children per GPU (0 without one), the GPUs
    # counted the one way the worker counts them.
    from config import load_settings

    print(pool_children(load_settings()))
