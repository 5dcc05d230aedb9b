"""What a pool child does with a batch: move its jobs to `running` (tasks/jobstate.py refuses
the cancelled, the expired and the already finished), run the model once over all their
inputs, give each job its terminal status and result in one atomic step, and report a typed
outcome per job to the parent.

Results are stored here, in the child, before the call returns, so the parent acknowledges a
job only after its result is stored (late ack): a child that dies mid-batch loses nothing.
A Redis error on the way (a restart, a stall, a failover) is retried for a while and then
reported as RETRY: the parent puts the job back on its queue. It never fails the job.
"""
from __future__ import annotations

import enum
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import orjson
import redis
from celery import current_app

from tasks import tracing, transport
from tasks.errors import JobFailed
from tasks.jobstate import Final, JobError, Status
from tasks.logs import trace
from tasks.names import PRIORITIES
from tasks.redis_client import is_transient
from tasks.results import encode as encode_outputs
from tasks.webhooks import DELIVER_TASK
from tasks.webhooks import QUEUE as WEBHOOK_QUEUE
from workers import metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"  # result stored
    FAILED = "failed"  # failure stored
    NOT_RUN = "not_run"  # cancelled, expired, missing or already finished: acknowledge
    RETRY = "retry"  # nothing stored (Redis unavailable): back to the queue


@dataclass(frozen=True)
class JobOutcome:
    job_id: str
    outcome: Outcome
    runtime: float = 0.0
    outputs: int = 0
    error: JobError | None = None
    reason: str = ""  # NOT_RUN: why ("cancelled", "expired", "succeeded", ...)


# (job id, task kwargs, trace headers: the job's trace_id and its W3C traceparent, if any)
JobPayload = tuple[str, dict, dict]


def _with_retries(call: Callable[[], T], what: str, patience_s: float) -> T:
    """`call` until it works, through transient Redis errors, for up to `patience_s`."""
    deadline = time.monotonic() + patience_s
    pause = 0.2
    while True:
        try:
            return call()
        except redis.RedisError as exc:
            if not is_transient(exc) or time.monotonic() + pause > deadline:
                raise
            logger.warning("Redis unavailable to %s (%s); retrying in %.1fs", what, exc, pause)
            time.sleep(pause)
            pause = min(pause * 2, 2.0)


def webhook_message(app: Any, job_id: str, kwargs: dict, trace_id: Any, status: Status):
    """The delivery a job asked for, as a task message `finish` queues with its result. Its
    arguments are the job and the event only: the deliverer reads the URL and the result from
    Redis (tasks/webhooks.py), so no inspector sees them."""
    hook = kwargs.get("webhook")
    event = status.value
    if not hook or event not in (hook.get("events") or ()):
        return None
    delivery = {"job_id": job_id, "event": event, "trace_id": trace_id}
    return transport.task_message(app, DELIVER_TASK, str(uuid.uuid4()), delivery,
                                  queue=WEBHOOK_QUEUE, priority=PRIORITIES["normal"])


def run_batch(model: str, jobs: list[JobPayload]) -> list[JobOutcome]:
    from workers.runtime import runtime  # the child's loaded models

    app = current_app
    rt = runtime()
    if not rt.ready:
        # Not this batch's fault: its jobs go back to the queue, for a child that can run them.
        logger.error("runtime is %s: %d job(s) back to their queue", rt.state.value, len(jobs))
        return [JobOutcome(job_id, Outcome.RETRY) for job_id, _kw, _t in jobs]
    patience = rt.settings.redis_retry_s
    worker = f"{rt.member}/{os.getpid()}"  # node name / child index / pid
    ids = [job_id for job_id, _kw, _t in jobs]
    items = sum(len(kw.get("inputs") or []) for _id, kw, _t in jobs)
    # Which batch a job ran in, so a client (and the tests) can see batching at work.
    batch_id = uuid.uuid4().hex
    batch_info = {"id": batch_id, "jobs": len(jobs), "items": items}
    batch = orjson.dumps(batch_info).decode()
    try:
        decisions = _with_retries(lambda: rt.jobs.start(ids, worker=worker, batch=batch),
                                  "start a batch", patience)
    except redis.RedisError:
        # Fail closed: a job whose start could not be recorded might have been cancelled.
        logger.warning("could not mark %d job(s) started; back to the queue", len(ids),
                       exc_info=True)
        return [JobOutcome(job_id, Outcome.RETRY) for job_id in ids]

    not_run = [JobOutcome(job_id, Outcome.NOT_RUN, reason=decision)
               for job_id, decision in zip(ids, decisions) if decision != "run"]
    jobs = [job for job, decision in zip(jobs, decisions) if decision == "run"]
    if not jobs:
        return not_run
    items = sum(len(kw.get("inputs") or []) for _id, kw, _t in jobs)
    started_ns = time.time_ns()
    if logger.isEnabledFor(logging.DEBUG):
        for job_id, _kwargs, headers in jobs:
            with trace(headers.get("trace_id")):
                logger.debug("job %s started: model=%s batch of %d job(s)", job_id, model,
                             len(jobs))
    now = time.time()
    for _id, kw, _t in jobs:
        submitted = kw.get("submitted_at")
        if isinstance(submitted, (int, float)):
            metrics.get().queue_wait.labels(model).observe(max(now - submitted, 0.0))

    started = time.monotonic()
    model_ns = time.time_ns()
    results = rt.run(model, [(kw.get("inputs") or [], kw.get("options") or {})
                             for _id, kw, _t in jobs])
    model_ns = (model_ns, time.time_ns())
    elapsed = time.monotonic() - started
    metrics.get().inference.labels(model).observe(elapsed)
    metrics.get().batch_size.labels(model).observe(items)

    finals: list[Final] = []
    for (job_id, kwargs, headers), result in zip(jobs, results):
        trace_id = headers.get("trace_id")
        if isinstance(result, JobFailed):
            error = JobError(result.code, result.message)
            finals.append(Final(job_id, Status.FAILED,
                                transport.result_meta(app, job_id, Status.FAILED, result),
                                error, webhook_message(app, job_id, kwargs, trace_id,
                                                       Status.FAILED)))
        else:
            outputs = encode_outputs(result, kwargs.get("encoding_format"))
            finals.append(Final(job_id, Status.SUCCEEDED,
                                transport.result_meta(app, job_id, Status.SUCCEEDED,
                                                      {"outputs": outputs}),
                                None, webhook_message(app, job_id, kwargs, trace_id,
                                                      Status.SUCCEEDED)))
    write_ns = time.time_ns()
    try:
        written = _with_retries(
            lambda: rt.jobs.finish(finals, result_ttl_s=rt.settings.result_ttl_s),
            "store results", patience)
    except redis.RedisError:
        logger.warning("could not store the results of %d job(s); back to the queue",
                       len(finals), exc_info=True)
        return [JobOutcome(f.job_id, Outcome.RETRY) for f in finals] + not_run
    rt.record_memory(model)
    tracing.batch_spans(
        model, [(job_id, headers, kw.get("submitted_at")) for job_id, kw, headers in jobs],
        batch=batch_info, started_ns=started_ns, model_ns=model_ns,
        write_ns=(write_ns, time.time_ns()), ended_ns=time.time_ns())

    outcomes: list[JobOutcome] = []
    for (job_id, kw, headers), result, final, fresh in zip(jobs, results, finals, written):
        ok = final.status is Status.SUCCEEDED
        if not fresh:
            # Another run of this job finished first (it was delivered twice); its result
            # stands and this one is dropped.
            outcomes.append(JobOutcome(job_id, Outcome.NOT_RUN, elapsed, reason="finished"))
            continue
        outcomes.append(JobOutcome(job_id, Outcome.SUCCEEDED if ok else Outcome.FAILED,
                                   elapsed, len(result) if ok else 0, final.error))
        metrics.get().jobs.labels(model, final.status.value).inc()
        metrics.get().items.labels(model, final.status.value).inc(len(kw.get("inputs") or []))
        if final.error is not None or logger.isEnabledFor(logging.DEBUG):
            with trace(headers.get("trace_id")):
                logger.log(logging.WARNING if final.error else logging.DEBUG,
                           "job %s %s in %.3fs%s", job_id, final.status.value, elapsed,
                           f": {final.error.code}: {final.error.message}" if final.error
                           else "")
    # One line a batch, naming each job with its status and trace id: grep either id to find
    # the batch that ran a job (a line a job, at DEBUG, would be thousands of lines a second).
    logger.info("batch %s of %s: %d job(s), %d item(s) in %.3fs: %s",
                batch_id, model, len(jobs), items, elapsed,
                ", ".join(f"{o.job_id} {o.outcome.value} trace_id={h.get('trace_id') or '-'}"
                          for o, (_id, _kw, h) in zip(outcomes, jobs)))
    return outcomes + not_run
