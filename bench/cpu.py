"""Where the CPU goes: one configuration's stack under a closed loop, and each process's CPU per
job, with the worker's batch size and how much of the time its child spends in the model.

    python -m bench.cpu --config service --clients 16 --seconds 8

This is the measurement behind "What bounds it" in bench/README.md. It prints one JSON object.
The worker's batch metrics exist for this service's worker only (not for the celery-batches
peer).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import requests

from bench.__main__ import MODELS, api_processes, configs_for, run_load, start_stack
from scripts.stack import wait_until


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _sum(metrics_text: str, name: str) -> float:
    """The sum of a metric's samples (over its labels) in Prometheus text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _metrics(url: str) -> str:
    """The worker's metrics, or "" for a worker that serves none (the celery-batches peer)."""
    try:
        return requests.get(url, timeout=5).text
    except requests.RequestException:
        return ""


def measure(model: str, config_name: str, clients: int, seconds: float) -> dict:
    spec = MODELS[model]
    config = next(c for c in configs_for(spec) if c.name == config_name)
    workdir = Path(tempfile.mkdtemp(prefix="iq-bench-cpu-"))
    stack = start_stack(workdir, model, spec, config, SimpleNamespace(clients=[clients]))
    try:
        redis_svc, worker, web = stack.services
        wait_until(lambda: requests.get(f"{stack.url}/readyz", timeout=2).status_code == 200,
                   180, f"{config_name} worker")
        run_load(stack.url, model, clients, 1, 2.0, 0.5)  # warm every path first
        main = psutil.Process(worker.proc.pid)
        groups = {
            "redis": [psutil.Process(redis_svc.proc.pid)],
            "worker main": [main],
            "worker child": main.children(recursive=True),
            "api": api_processes(web.proc.pid),
        }
        metrics_url = worker.extra["metrics_url"]
        before_metrics = _metrics(metrics_url)
        before = {name: _cpu_seconds(procs) for name, procs in groups.items()}
        started = time.monotonic()
        load = run_load(stack.url, model, clients, 1, seconds, 0.0)
        wall = time.monotonic() - started
        after = {name: _cpu_seconds(procs) for name, procs in groups.items()}
        after_metrics = _metrics(metrics_url)
    finally:
        stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    jobs = max(load["jobs"], 1)
    out = {
        "model": model, "config": config_name, "clients": clients, "seconds": round(wall, 2),
        "jobs": load["jobs"], "items_per_s": round(load["items_per_s"], 1), "p50_ms": round(load["p50_ms"], 1),
        "cpu_ms_per_job": {name: round(1000 * (after[name] - before[name]) / jobs, 2)
                           for name in groups},
        "cores_used": {name: round((after[name] - before[name]) / wall, 2) for name in groups},
    }
    batches = _sum(after_metrics, "iq_batch_size_count") - _sum(before_metrics,
                                                                 "iq_batch_size_count")
    if batches:
        items = _sum(after_metrics, "iq_batch_size_sum") - _sum(before_metrics,
                                                                "iq_batch_size_sum")
        model_s = _sum(after_metrics, "iq_inference_seconds_sum") - _sum(
            before_metrics, "iq_inference_seconds_sum")
        out.update(batches=int(batches), items=int(items), mean_batch_items=round(items / batches, 2),
                   model_ms_per_batch=round(1000 * model_s / batches, 1),
                   model_busy=round(model_s / wall, 2))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="minilm-embed", choices=sorted(MODELS))
    p.add_argument("--config", default="service",
                   choices=[c.name for c in configs_for(MODELS["minilm-embed"])])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=8.0)
    a = p.parse_args()
    print(json.dumps(measure(a.model, a.config, a.clients, a.seconds), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
