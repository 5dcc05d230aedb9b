"""A worker draining a backlog: what a batch costs the child beside the model, without the API.

    python -m bench.drain --jobs 3000 --rounds 3 [--baseline main]

Bench.cpu's 64-client ratio depends on the API and the load generator keeping the worker fed,
which on a shared 2-core machine they often do not (batches of 18-21 at load 4-12). Here the
jobs are queued first (one-input `synthetic` jobs, through the API, no worker running), then
the worker is started and drains them in full batches: the device waits only for the child's
own serial work (its start and finish scripts, its bookkeeping) and the hand-over of its next
batch. From the job records (Redis's clock, milliseconds): the drain's span from the first
start to the last finish, items/s and its ratio to the batch-32 ceiling, the batches and their
mean size, and the cycle a batch (one start to the next) beside the model's time a batch
(the worker's `iq_inference_seconds`); their difference, `outside_model_ms`, is what the
device waits a batch. With `--baseline REV`, that commit's stack drains the
same backlog, alternating with this checkout's, round by round. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
import requests
import yaml

from bench import baseline
from bench.harness import MODELS
from scripts import stack as launcher
from scripts.stack import wait_until
from tasks.jobstate import JobState
from bench.usage import metric_sum

MODEL = "synthetic"
CEILING = 32 / (MODELS[MODEL]["base_ms"] + 32 * MODELS[MODEL]["per_item_ms"]) * 1000


def _submit(url: str, n: int) -> list[str]:
    def one(i: int) -> str:
        r = requests.post(f"{url}/v1/jobs", json={"model": MODEL, "inputs": [f"x{i}"]},
                          timeout=30)
        if r.status_code >= 400:
            raise RuntimeError(f"submit: {r.status_code} {r.text[:300]}")
        return r.json()["id"]
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def drain(launch, workdir: Path, jobs: int) -> dict:
    """One stack: `jobs` queued, then a worker started; the drain as the records tell it."""
    models_file = workdir / "models.yaml"
    models_file.write_text(yaml.safe_dump(
        {"models": {MODEL: {**MODELS[MODEL], "max_queue_depth": jobs + 100}}}))
    redis_svc = launch.start_redis(workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("IQ_")}
    env.update(REDIS_URL=redis_svc.extra["url"], IQ_MODELS_FILE=str(models_file),
               HF_HUB_OFFLINE="1", IQ_LOG_LEVEL="WARNING")
    services = [redis_svc]
    try:
        web = launch.start_web(env, workdir)
        services.append(web)
        ids = _submit(web.extra["url"], jobs)
        worker = launch.start_worker("drain", env, workdir, None)
        services.append(worker)
        metrics = worker.extra["metrics_url"]

        def done() -> float:
            try:
                return metric_sum(requests.get(metrics, timeout=5).text, "iq_batch_size_sum")
            except requests.RequestException:
                return 0.0
        wait_until(lambda: done() >= jobs, 600, "the backlog drained")
        text = requests.get(metrics, timeout=5).text
        state = JobState(redis.Redis.from_url(redis_svc.extra["url"]), 3600, 3600)
        records = [state.read(i) for i in ids]
    finally:
        for svc in reversed(services):
            svc.stop()
    batches: dict[str, list] = {}
    for rec in records:
        batches.setdefault(rec.batch["id"], []).append(rec)
    starts = sorted(min(r.started_at for r in b).timestamp() for b in batches.values())
    first = min(r.started_at for r in records).timestamp()
    last = max(r.finished_at for r in records).timestamp()
    span = last - first
    model_s = metric_sum(text, "iq_inference_seconds_sum")
    calls = metric_sum(text, "iq_inference_seconds_count")
    cycles = [b - a for a, b in zip(starts, starts[1:])]
    # A batch's start after the last one's finish (Redis's milliseconds, both stamped by the
    # child): 0 or 1 where it rode in that finish's round trip (workers/broker/readahead.py).
    ends = sorted((min(r.started_at for r in b).timestamp(),
                   max(r.finished_at for r in b).timestamp()) for b in batches.values())
    gaps = [1000 * (b[0] - a[1]) for a, b in zip(ends, ends[1:])]
    return {"jobs": jobs, "runs": sum(r.runs for r in records), "span_s": round(span, 3),
            "items_per_s": round(jobs / span, 1), "ratio": round(jobs / span / CEILING, 3),
            "batches": len(batches), "mean_batch": round(jobs / len(batches), 2),
            "model_ms_per_batch": round(1000 * model_s / max(calls, 1), 2),
            "cycle_ms_p50": round(1000 * statistics.median(cycles), 2),
            "cycle_ms_mean": round(1000 * statistics.fmean(cycles), 2),
            # What the device waits a batch: the child's own work and the hand-over.
            "outside_model_ms": round(1000 * (statistics.fmean(cycles)
                                              - model_s / max(calls, 1)), 2),
            "model_busy": round(model_s / span, 3),
            "start_after_finish_ms_p50": round(statistics.median(gaps), 1),
            "started_within_1ms_of_finish": round(sum(g <= 1 for g in gaps) / len(gaps), 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="also this commit's stack, alternating")
    a = p.parse_args()
    trees = {"this": launcher}
    if a.baseline:
        trees[a.baseline] = baseline.launcher(baseline.checkout(a.baseline))
    out: dict = {"ceiling_items_per_s": round(CEILING, 1), "rounds": {n: [] for n in trees}}
    for r in range(a.rounds):
        for name in list(trees)[r % len(trees):] + list(trees)[:r % len(trees)]:
            workdir = Path(tempfile.mkdtemp(prefix="iq-bench-drain-"))
            try:
                out["rounds"][name].append({"load": round(os.getloadavg()[0], 1),
                                            **drain(trees[name], workdir, a.jobs)})
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            print(name, out["rounds"][name][-1], file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
