"""Worker metrics in Prometheus format, summed across the prefork children.

Children record into prometheus_client's multiprocess files; the worker's main process serves
them all (settings.worker_metrics_port, default 9808, 0: off; on worker_metrics_host, default
127.0.0.1, as every other process here binds; 0.0.0.0 for a Prometheus on another host).

prometheus_client picks its multiprocess mode from PROMETHEUS_MULTIPROC_DIR when it is first
imported, so nothing here imports it until the worker's main process has called `serve`,
which makes that folder (children inherit it) before anything records a value.
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from config import Settings

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# (kind, name, help, labels, options): what the worker exports.
_DECLARED: tuple[tuple[str, str, str, tuple[str, ...], dict[str, Any]], ...] = (
    ("histogram", "iq_batch_size", "Items in one model call", ("model",),
     {"buckets": (1, 2, 4, 8, 16, 32, 64, 128, 256)}),
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
)


def families() -> set[str]:
    """The metric families the worker exports (counters with their `_total`), whether or not
    they have samples yet (the GPU gauges have none on a CPU-only host)."""
    return {name + ("_total" if kind == "counter" else "") for kind, name, *_ in _DECLARED}


@dataclass(frozen=True)
class WorkerMetrics:
    batch_size: Any
    queue_wait: Any
    inference: Any
    jobs: Any
    items: Any
    oom_splits: Any
    gpu_allocated: Any
    gpu_reserved: Any


@lru_cache(maxsize=1)
def get() -> WorkerMetrics:
    """This process's metric objects, made on first use."""
    import prometheus_client

    kinds = {"histogram": prometheus_client.Histogram, "counter": prometheus_client.Counter,
             "gauge": prometheus_client.Gauge}
    made = [kinds[kind](name, help_, list(labels), **options)
            for kind, name, help_, labels, options in _DECLARED]
    return WorkerMetrics(*made)


def record_gpu_memory(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    get().gpu_allocated.labels(device).set(torch.cuda.memory_allocated(device))
    get().gpu_reserved.labels(device).set(torch.cuda.memory_reserved(device))


def child_exited(pid: int) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


def serve(settings: Settings) -> None:
    """In the worker's main process, before its pool starts: the children's multiprocess
    folder (a fresh one per worker unless PROMETHEUS_MULTIPROC_DIR names one), and every
    child's metrics served on settings.worker_metrics_port."""
    if not os.environ.get(MULTIPROC_ENV):
        os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="iq-worker-metrics-")
    port = settings.worker_metrics_port
    if port <= 0:
        return
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    host = settings.worker_metrics_host
    try:
        start_http_server(port, addr=host, registry=registry)
        logger.info("worker metrics on %s:%d/metrics", host, port)
    except OSError as exc:
        logger.warning("worker metrics not served: port %d: %s", port, exc)
