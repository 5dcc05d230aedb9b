"""Worker metrics in Prometheus format, summed across the prefork children.

Children record into prometheus_client's multiprocess files; the worker's main process serves
them all (settings.worker_metrics_port, default 9808, or the first free port after it when
another worker on the host has it; 0: off; on worker_metrics_host, default 127.0.0.1, as every
other process here binds; 0.0.0.0 for a Prometheus on another host). The address is logged
and reported in Redis with the worker's reload status (scripts/reload.py shows it).

prometheus_client picks its multiprocess mode from PROMETHEUS_MULTIPROC_DIR when it is first
imported, so nothing here imports it until the worker's main process has called `serve`,
which makes that folder (children inherit it) before anything records a value.
"""
from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from config import Settings

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Ports tried from the configured one: room for a worker per GPU of a large host, and more.
PORT_RANGE = 64

# (kind, name, help, labels, options): what the worker exports.
_DECLARED: tuple[tuple[str, str, str, tuple[str, ...], dict[str, Any]], ...] = (
    ("histogram", "iq_batch_size", "Items in one model call (that returned)", ("model",),
     {"buckets": (1, 2, 4, 8, 16, 32, 64, 128, 256)}),
    ("histogram", "iq_batch_jobs", "Jobs in one dispatched batch (one or more model calls)",
     ("model",), {"buckets": (1, 2, 4, 8, 16, 32, 64, 128, 256)}),
    ("histogram", "iq_queue_wait_seconds", "From submission to the start of its batch",
     ("model",), {"buckets": (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                              30, 60, 300)}),
    ("histogram", "iq_inference_seconds", "Model time of one batch", ("model",),
     {"buckets": (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)}),
    ("counter", "iq_jobs", "Jobs finished", ("model", "outcome"), {}),
    ("counter", "iq_items", "Inputs finished", ("model", "outcome"), {}),
    ("counter", "iq_oom_splits", "Batches halved after CUDA out-of-memory", ("model",), {}),
    ("gauge", "iq_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated", ("device",),
     {"multiprocess_mode": "liveall"}),
    ("gauge", "iq_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved", ("device",),
     {"multiprocess_mode": "liveall"}),
    # The device's busy share (workers/child/handlers/busy.py): its time running a model call, and
    # its idle time while work for it waited; their ratio over the last 30 s as a gauge.
    ("counter", "iq_device_busy_seconds", "Device time running this model's calls",
     ("model", "device"), {}),
    ("counter", "iq_device_idle_waiting_seconds",
     "Device idle while this model's work waited for it", ("model", "device"), {}),
    ("gauge", "iq_device_busy_share",
     "Device busy / (busy + idle while work waited), last 30 s of the child's calls",
     ("model", "device"), {"multiprocess_mode": "liveall"}),
    ("gauge", "iq_gpu_utilization_ratio", "NVML's GPU utilisation (0-1), where pynvml is present",
     ("device",), {"multiprocess_mode": "liveall"}),
)


def families() -> set[str]:
    """The metric families the worker exports (counters with their `_total`), whether or not
    they have samples yet (the GPU gauges have none on a CPU-only host)."""
    return {name + ("_total" if kind == "counter" else "") for kind, name, *_ in _DECLARED}


@dataclass(frozen=True)
class WorkerMetrics:
    batch_size: Any
    batch_jobs: Any
    queue_wait: Any
    inference: Any
    jobs: Any
    items: Any
    oom_splits: Any
    gpu_allocated: Any
    gpu_reserved: Any
    device_busy: Any
    device_idle_waiting: Any
    device_busy_share: Any
    gpu_utilization: Any


@lru_cache(maxsize=1)
def get() -> WorkerMetrics:
    """This process's metric objects, made on first use."""
    import prometheus_client

    kinds = {"histogram": prometheus_client.Histogram, "counter": prometheus_client.Counter,
             "gauge": prometheus_client.Gauge}
    made = [kinds[kind](name, help_, list(labels), **options)
            for kind, name, help_, labels, options in _DECLARED]
    return WorkerMetrics(*made)


def record_device(model: str, device: str, busy_s: float, idle_s: float,
                  share: float | None) -> None:
    """A model call's device time and the idle time before it while work waited (in the
    child: workers/child/handlers/base.py DeviceTimer)."""
    get().device_busy.labels(model, device).inc(busy_s)
    get().device_idle_waiting.labels(model, device).inc(idle_s)
    if share is not None:
        get().device_busy_share.labels(model, device).set(share)


def child_exited(pid: int) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


def serve(settings: Settings, own_folder: Path) -> str | None:
    """In the worker's main process, before its pool starts: the children's multiprocess
    folder (a fresh one per worker, in its `own_folder`, gone at its exit: workers/spawn.py;
    unless PROMETHEUS_MULTIPROC_DIR names one), and every child's metrics served on
    settings.worker_metrics_port or the first free port after it; the address it serves
    them on."""
    if not os.environ.get(MULTIPROC_ENV):
        (own_folder / "metrics").mkdir(mode=0o700)
        os.environ[MULTIPROC_ENV] = str(own_folder / "metrics")
    if settings.worker_metrics_port <= 0:
        return None
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return serve_registry(registry, settings.worker_metrics_port, settings.worker_metrics_host,
                          "worker metrics")


def serve_registry(registry: Any, first: int, host: str, what: str) -> str | None:
    """`registry` served on the first free port from `first` (up to PORT_RANGE ports on), so
    that several workers on one host never collide; the address, logged, or None."""
    from prometheus_client import start_http_server

    for port in range(first, min(first + PORT_RANGE, 65536)):
        try:
            start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                logger.warning("%s not served: port %d: %s", what, port, exc)
                return None
            continue
        taken = f" ({first}-{port - 1} taken)" if port != first else ""
        logger.info("%s on %s:%d/metrics%s", what, host, port, taken)
        return f"{host}:{port}"
    logger.warning("%s not served: ports %d-%d are all taken", what, first,
                   first + PORT_RANGE - 1)
    return None
