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

from celery import current_app
from celery.utils.log import current_process_index

from tasks.errors import JobFailed
from tasks.records import job_key, now_iso

logger = logging.getLogger(__name__)

# (job id, succeeded, runtime seconds, summary: "n outputs" or "code: message")
JobOutcome = tuple[str, bool, float, str]
# (job id, task kwargs, trace id)
JobPayload = tuple[str, dict, Any]


# Only a record the API wrote gets a start time: an expired record must not come back
# without its TTL.
_MARK_STARTED = """
if redis.call('exists', KEYS[1]) == 1 then
  redis.call('hset', KEYS[1], 'started_at', ARGV[1], 'worker', ARGV[2], 'batch', ARGV[3])
end
"""


def _mark_started(backend: Any, jobs: list[JobPayload], started_at: str, worker: str) -> None:
    client = backend.client
    script = client.register_script(_MARK_STARTED)
    # Which batch a job ran in, so a client (and the tests) can see batching at work.
    items = sum(len(kw.get("inputs") or []) for _id, kw, _t in jobs)
    batch = json.dumps({"id": uuid.uuid4().hex, "jobs": len(jobs), "items": items})
    with client.pipeline(transaction=False) as pipe:
        for job_id, _kwargs, _trace in jobs:
            script(keys=[job_key(job_id)], args=[started_at, worker, batch], client=pipe)
        pipe.execute()


def run_batch(model: str, jobs: list[JobPayload]) -> list[JobOutcome]:
    from workers.runtime import runtime  # the child's loaded models

    app = current_app
    backend = app.backend
    started = time.monotonic()
    worker = f"{os.uname().nodename}/{current_process_index(base=0)}/{os.getpid()}"
    try:
        _mark_started(backend, jobs, now_iso(), worker)
    except Exception:  # the record is informational; a Redis blip must not fail the batch
        logger.warning("could not mark %d job(s) started", len(jobs), exc_info=True)

    for job_id, _kwargs, trace in jobs:
        logger.info("job %s started (model=%s, trace_id=%s)", job_id, model, trace)
    results = runtime().run(model, [(kw.get("inputs") or [], kw.get("options") or {})
                                    for _id, kw, _t in jobs])
    elapsed = time.monotonic() - started

    outcomes: list[JobOutcome] = []
    for (job_id, _kwargs, trace), result in zip(jobs, results):
        if isinstance(result, JobFailed):
            backend.mark_as_failure(job_id, result)
            outcomes.append((job_id, False, elapsed, f"{result.code}: {result.message}"))
            logger.info("job %s failed: %s (trace_id=%s)", job_id, result, trace)
        else:
            backend.mark_as_done(job_id, {"outputs": result})
            outcomes.append((job_id, True, elapsed, f"{len(result)} output(s)"))
    return outcomes
