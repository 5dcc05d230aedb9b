"""What a pool child does with a batch: mark its jobs started, run the model once over all
their inputs, store each job's own result, and report a small outcome per job to the parent.

Results are written here, in the child, before the call returns, so the parent acknowledges a
job only after its result is stored (late ack): a child that dies mid-batch loses nothing.
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from typing import Any

import orjson
from celery import current_app, states

from tasks.errors import JobFailed
from tasks.logs import trace
from tasks.webhooks import DELIVER_TASK
from workers import metrics
from tasks.records import job_key, now_iso

logger = logging.getLogger(__name__)

# (job id, succeeded, runtime seconds, summary: "n outputs" or "code: message")
JobOutcome = tuple[str, bool, float, str]
# (job id, task kwargs, trace id)
JobPayload = tuple[str, dict, Any]


# Only a record the API wrote gets a start time: an expired record must not come back
# without its TTL.
# A job cancelled through the API is refused here (returns 0): app/store.py's cancel script
# and this one decide atomically whether a job runs or is cancelled.
_MARK_STARTED = """
if redis.call('exists', KEYS[1]) == 0 then return 1 end
if redis.call('hexists', KEYS[1], 'cancelled_at') == 1 then return 0 end
redis.call('hset', KEYS[1], 'started_at', ARGV[1], 'worker', ARGV[2], 'batch', ARGV[3])
return 1
"""
CANCELLED = "cancelled"


def _mark_started(backend: Any, jobs: list[JobPayload], started_at: str,
                  worker: str, items: int) -> list[bool]:
    client = backend.client
    script = client.register_script(_MARK_STARTED)
    # Which batch a job ran in, so a client (and the tests) can see batching at work.
    batch = json.dumps({"id": uuid.uuid4().hex, "jobs": len(jobs), "items": items})
    with client.pipeline(transaction=False) as pipe:
        for job_id, _kwargs, _trace in jobs:
            script(keys=[job_key(job_id)], args=[started_at, worker, batch], client=pipe)
        return [bool(x) for x in pipe.execute()]


def run_batch(model: str, jobs: list[JobPayload]) -> list[JobOutcome]:
    from workers.runtime import runtime  # the child's loaded models

    app = current_app
    backend = app.backend
    rt = runtime()
    worker = f"{rt.member}/{os.getpid()}"  # node name / child index / pid
    items = sum(len(kw.get("inputs") or []) for _id, kw, _t in jobs)
    try:
        runnable = _mark_started(backend, jobs, now_iso(), worker, items)
    except Exception:  # the record is informational; a Redis blip must not fail the batch
        logger.warning("could not mark %d job(s) started", len(jobs), exc_info=True)
        runnable = [True] * len(jobs)
    cancelled = [(job_id, False, 0.0, CANCELLED)
                 for (job_id, _kw, _t), ok in zip(jobs, runnable) if not ok]
    if cancelled:
        jobs = [job for job, ok in zip(jobs, runnable) if ok]
        items = sum(len(kw.get("inputs") or []) for _id, kw, _t in jobs)
    if not jobs:
        return cancelled

    for job_id, _kwargs, trace_id in jobs:
        with trace(trace_id):
            logger.info("job %s started: model=%s batch of %d job(s)", job_id, model, len(jobs))
    now = time.time()
    for _id, kw, _t in jobs:
        submitted = kw.get("submitted_at")
        if isinstance(submitted, (int, float)):
            metrics.QUEUE_WAIT.labels(model).observe(max(now - submitted, 0.0))
    started = time.monotonic()
    results = rt.run(model, [(kw.get("inputs") or [], kw.get("options") or {})
                             for _id, kw, _t in jobs])
    elapsed = time.monotonic() - started
    metrics.INFERENCE.labels(model).observe(elapsed)
    metrics.BATCH_SIZE.labels(model).observe(items)

    outcomes: list[JobOutcome] = []
    stored: list[tuple[str, str, Any]] = []
    for (job_id, _kwargs, trace_id), result in zip(jobs, results):
        if isinstance(result, JobFailed):
            stored.append((job_id, states.FAILURE, result))
            outcomes.append((job_id, False, elapsed, f"{result.code}: {result.message}"))
        else:
            stored.append((job_id, states.SUCCESS, {"outputs": result}))
            outcomes.append((job_id, True, elapsed, f"{len(result)} output(s)"))
    store_results(backend, stored)
    _queue_webhooks(app, model, jobs, stored)
    rt.record_memory(model)
    for (job_id, kw, trace_id), (_id, ok, _rt, summary) in zip(jobs, outcomes):
        outcome = "succeeded" if ok else "failed"
        metrics.JOBS.labels(model, outcome).inc()
        metrics.ITEMS.labels(model, outcome).inc(len(kw.get("inputs") or []))
        with trace(trace_id):
            logger.info("job %s %s in %.3fs: %s", job_id, outcome, elapsed, summary)
    return outcomes + cancelled


def _queue_webhooks(app: Any, model: str, jobs: list[JobPayload],
                    stored: list[tuple[str, str, Any]]) -> None:
    """Deliveries for jobs that asked for one, queued once their result is stored."""
    for (job_id, kwargs, trace_id), (_id, state, result) in zip(jobs, stored):
        hook = kwargs.get("webhook")
        event = "succeeded" if state == states.SUCCESS else "failed"
        if not hook or event not in (hook.get("events") or ()):
            continue
        payload: dict[str, Any] = {"id": job_id, "model": model, "status": event}
        if event == "succeeded":
            payload["result"] = result
        else:
            payload["error"] = {"code": result.code, "message": result.message}
        try:
            app.send_task(DELIVER_TASK, args=(hook["url"], event, job_id, payload, trace_id))
        except Exception:  # a webhook must never fail the job it reports on
            with trace(trace_id):
                logger.warning("could not queue the webhook of job %s", job_id, exc_info=True)


# Celery's own store_result reads the current meta first so that a job that already succeeded
# (a redelivered duplicate) is never overwritten; this does the same inside Redis, for a whole
# batch in one round trip. The meta is JSON whose first key is "status" (written compact here,
# with a space by Celery's own encoder).
_STORE_RESULT = """
local current = redis.call('get', KEYS[1])
if current and string.find(string.sub(current, 1, 64), '"status":%s*"SUCCESS"') then
  return 0
end
redis.call('setex', KEYS[1], ARGV[2], ARGV[1])
redis.call('publish', KEYS[1], ARGV[1])
return 1
"""


def store_results(backend: Any, items: list[tuple[str, str, Any]]) -> None:
    """Each job's own result in the result backend (and its publish, which wakes `?wait`)."""
    client = backend.client
    script = client.register_script(_STORE_RESULT)
    expires = int(backend.expires or 86_400)
    with client.pipeline(transaction=False) as pipe:
        for job_id, state, result in items:
            meta = backend._get_result_meta(result=backend.encode_result(result, state),
                                            state=state, traceback=None, request=None)
            meta["task_id"] = job_id
            # orjson: the standard library takes ~10 ms for a job of 32 embeddings. A NaN or
            # infinite output is written as null (JSON has neither).
            script(keys=[backend.get_key_for_task(job_id)], args=[orjson.dumps(meta), expires],
                   client=pipe)
        pipe.execute()
