"""Worker metrics in Prometheus format, summed across the prefork children.

Children record into prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, made
per worker before any child starts); the worker's main process serves them all on
IQ_WORKER_METRICS_PORT (default 9808; 0 turns it off) on IQ_WORKER_METRICS_HOST (default
127.0.0.1, as every other process here binds; 0.0.0.0 for a Prometheus on another host).
"""
from __future__ import annotations

import logging
import os
import tempfile

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def prepare_multiprocess_dir() -> str:
    """Must run before prometheus_client is imported in this process or any child."""
    if not os.environ.get(MULTIPROC_ENV):
        os.environ[MULTIPROC_ENV] = tempfile.mkdtemp(prefix="iq-worker-metrics-")
    return os.environ[MULTIPROC_ENV]


prepare_multiprocess_dir()

from prometheus_client import Counter, Gauge, Histogram  # noqa: E402

BATCH_SIZE = Histogram("iq_batch_size", "Items in one model call", ["model"],
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
QUEUE_WAIT = Histogram("iq_queue_wait_seconds", "From submission to the start of its batch",
                       ["model"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                           1, 2.5, 5, 10, 30, 60, 300))
INFERENCE = Histogram("iq_inference_seconds", "Model time of one batch", ["model"],
                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                               10, 30))
JOBS = Counter("iq_jobs_total", "Jobs finished", ["model", "outcome"])
ITEMS = Counter("iq_items_total", "Inputs finished", ["model", "outcome"])
OOM_SPLITS = Counter("iq_oom_splits_total", "Batches halved after CUDA out-of-memory",
                     ["model"])
GPU_ALLOCATED = Gauge("iq_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated",
                      ["device"], multiprocess_mode="liveall")
GPU_RESERVED = Gauge("iq_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved",
                     ["device"], multiprocess_mode="liveall")


def record_gpu_memory(device: str) -> None:
    if not device.startswith("cuda"):
        return
    import torch

    GPU_ALLOCATED.labels(device).set(torch.cuda.memory_allocated(device))
    GPU_RESERVED.labels(device).set(torch.cuda.memory_reserved(device))


def child_exited(pid: int) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)


def serve(port: int) -> None:
    """Serve every child's metrics from the worker's main process."""
    if port <= 0:
        return
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    host = os.environ.get("IQ_WORKER_METRICS_HOST", "127.0.0.1")
    try:
        start_http_server(port, addr=host, registry=registry)
        logger.info("worker metrics on %s:%d/metrics", host, port)
    except OSError as exc:
        logger.warning("worker metrics not served: port %d: %s", port, exc)
