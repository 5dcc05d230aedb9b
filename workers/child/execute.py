"""What a pool child does with a batch: move its jobs to `running` (tasks/jobstate.py refuses
the cancelled, the expired and the already finished), run the model once over all their
inputs, give each job its terminal status and result in one atomic step, and report a typed
outcome per job to the parent.

Results are stored here, in the child, before the call returns, so the parent acknowledges a
job only after its result is stored (late ack): a child that dies mid-batch loses nothing.
A Redis error on the way (a restart, a stall, a failover) is retried for a while; then a job
not started yet is reported as RETRY (the parent puts it back on its queue) and a job that ran
as UNSTORED with its result (the parent keeps it and stores it when Redis takes writes again:
running it again would run it twice). It never fails the job.

A job is started only while its message is still on this worker's in-flight record
(`held_by`): one that another worker took back while this worker's lease had lapsed (a network
cut) is left to that worker. The finish that stores the batch's results acknowledges their
messages on that record in the same step (tasks/jobstate.py `finish`): the outcomes say so
(`acked`), and the parent settles those without a round trip of its own.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

import redis

from tasks import tracing
from tasks.errors import JobError
from tasks.jobstate import Final, StartDecision, Status, batch_text
from tasks.logs import trace
from tasks.redis_client import is_transient
from workers import metrics
from workers.child.batch import FOREIGN, BatchJob, JobOutcome, Outcome, failed, succeeded
from workers.child.handlers import busy

if TYPE_CHECKING:
    from workers.child.runtime import ModelRuntime

logger = logging.getLogger(__name__)

T = TypeVar("T")


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


def run_batch(model: str, jobs: list[BatchJob], held_by: str = "") -> list[JobOutcome]:
    """The pool's entry point, in the child: its runtime (its Celery app and loaded models)
    runs the batch. `held_by`: the in-flight hash that holds the jobs' messages."""
    from workers.child.runtime import runtime

    rt = runtime()
    return execute(rt.app, rt, model, jobs, held_by)


@dataclass
class _Ran:
    """The model's pass over a batch: per job its outputs or its error, and the timings."""
    returned: list[list | JobError]
    elapsed: float
    started_ns: int
    model_ns: tuple[int, int]


def execute(app: Any, rt: ModelRuntime, model: str, jobs: list[BatchJob],
            held_by: str = "") -> list[JobOutcome]:
    """Start, run, store, report: the batch's outcomes, one per job."""
    if not rt.ready:
        # Not this batch's fault: its jobs go back to the queue, for a child that can run them.
        logger.error("runtime is %s: %d job(s) back to their queue", rt.state.value, len(jobs))
        return _retry(job.id for job in jobs)
    batch = {"id": uuid.uuid4().hex[:12], "jobs": len(jobs),  # kept in every job's record
             "items": sum(len(job.args.inputs) for job in jobs)}
    started = _start(rt, jobs, batch, held_by)
    if started is None:
        return _retry(job.id for job in jobs)
    to_run, not_run = started
    if not to_run:
        return not_run
    ran = _run_model(rt, model, to_run)
    finals = [failed(app, job, out) if isinstance(out, JobError) else succeeded(app, job, out)
              for job, out in zip(to_run, ran.returned)]
    write_ns = time.time_ns()
    held = (held_by, [job.tag for job in to_run]) if held_by else None
    try:
        written = _with_retries(
            lambda: rt.jobs.finish(finals, result_ttl_s=rt.settings.result_ttl_s,
                                   model_version=rt.versions.get(model, ""), held=held),
            "store results", rt.settings.redis_retry_s)
    except redis.RedisError:
        logger.warning("could not store the results of %d job(s) yet; the worker keeps them "
                       "until Redis takes them", len(finals), exc_info=True)
        return [JobOutcome(f.job_id, Outcome.UNSTORED, ran.elapsed, final=f)
                for f in finals] + not_run
    rt.record_memory(model)
    tracing.batch_spans(
        model, [(job.id, job.trace, job.args.submitted_at) for job in to_run], batch=batch,
        version=rt.versions.get(model, ""),
        started_ns=ran.started_ns, model_ns=ran.model_ns, write_ns=(write_ns, time.time_ns()),
        ended_ns=time.time_ns())
    outcomes = _outcomes(model, to_run, ran, finals, written, rt.versions.get(model, ""),
                         acked=held is not None)
    _log_batch(model, batch["id"], to_run, ran.elapsed, outcomes)
    return outcomes + not_run


def _retry(job_ids: Iterable[str]) -> list[JobOutcome]:
    return [JobOutcome(job_id, Outcome.RETRY) for job_id in job_ids]


def _start(rt: ModelRuntime, jobs: list[BatchJob], batch: dict,
           held_by: str) -> tuple[list[BatchJob], list[JobOutcome]] | None:
    """The jobs to run, and the outcomes of those not to run; None when Redis would not
    record the start."""
    worker = f"{rt.member}/{os.getpid()}"  # node name / child index / pid
    # Which batch a job ran in, so a client (and the tests) can see batching at work.
    info = batch_text(batch)
    ids, tokens = [job.id for job in jobs], [job.token for job in jobs]
    held = (held_by, [job.tag for job in jobs]) if held_by else None
    try:
        decisions = _with_retries(
            lambda: rt.jobs.start(ids, worker=worker, batch=info, tokens=tokens, held=held),
            "start a batch", rt.settings.redis_retry_s)
    except redis.RedisError:
        # Fail closed: a job whose start could not be recorded might have been cancelled.
        logger.warning("could not mark %d job(s) started; back to the queue", len(ids),
                       exc_info=True)
        return None
    for job, decision in zip(jobs, decisions):
        if decision is StartDecision.FOREIGN:
            logger.warning(FOREIGN, job.id)
    to_run = [job for job, d in zip(jobs, decisions) if d is StartDecision.RUN]
    not_run = [JobOutcome(job.id, Outcome.NOT_RUN, reason=d)
               for job, d in zip(jobs, decisions) if d is not StartDecision.RUN]
    return to_run, not_run


def _run_model(rt: ModelRuntime, model: str, jobs: list[BatchJob]) -> _Ran:
    """One pass of the model over the jobs' inputs, with its metrics."""
    started_ns = time.time_ns()
    if logger.isEnabledFor(logging.DEBUG):
        for job in jobs:
            with trace(job.trace_id):
                logger.debug("job %s started: model=%s batch of %d job(s)", job.id, model,
                             len(jobs))
    now = time.time()
    submitted = [job.args.submitted_at for job in jobs if job.args.submitted_at is not None]
    for at in submitted:
        metrics.get().queue_wait.labels(model).observe(max(now - at, 0.0))
    started = time.monotonic()
    model_start_ns = time.time_ns()
    progress = _Progress(rt, jobs)
    # The busy share counts the device idle from the moment its earliest job was waiting.
    waiting_since = busy.monotonic_of(min(submitted), now, started) if submitted else None
    returned = rt.run(model, [(job.args.inputs, job.args.options) for job in jobs], progress,
                      waiting_since)
    model_ns = (model_start_ns, time.time_ns())
    elapsed = time.monotonic() - started
    metrics.get().inference.labels(model).observe(elapsed)
    for items in progress.calls:
        metrics.get().batch_size.labels(model).observe(items)
    metrics.get().batch_jobs.labels(model).observe(len(jobs))
    return _Ran(returned, elapsed, started_ns, model_ns)


class _Progress:
    """Told how many of a batch's items (in order) are done after each model call, it counts
    them in the records of jobs part done: those spanning several calls (a job larger than
    max_batch_size runs alone, as several calls). A job done is left for `finish`. Progress
    is a courtesy: a Redis error on the way is logged, never a job's failure. It also keeps
    the items of each model call, for `iq_batch_size`."""

    def __init__(self, rt: ModelRuntime, jobs: list[BatchJob]) -> None:
        self.rt = rt
        self.calls: list[int] = []  # the items of each model call, in order
        self.spans: list[tuple[str, int, int]] = []  # (job id, first item, items)
        first = 0
        for job in jobs:
            self.spans.append((job.id, first, len(job.args.inputs)))
            first += len(job.args.inputs)

    def __call__(self, done: int) -> None:
        self.calls.append(done - sum(self.calls))
        part_done = {job_id: done - first for job_id, first, items in self.spans
                     if first < done < first + items}
        if not part_done:
            return
        try:
            self.rt.jobs.progress(part_done)
        except redis.RedisError as exc:
            logger.warning("could not count the progress of %d job(s): %s", len(part_done),
                           exc)


def _outcomes(model: str, jobs: list[BatchJob], ran: _Ran, finals: list[Final],
              written: list[bool], version: str, acked: bool = False) -> list[JobOutcome]:
    """Each job's outcome, counted and logged; a job that another run finished first (it was
    delivered twice) keeps that run's result, and this one is dropped. `acked`: the finish
    acknowledged their messages."""
    outcomes: list[JobOutcome] = []
    for job, out, final, fresh in zip(jobs, ran.returned, finals, written):
        if not fresh:
            outcomes.append(JobOutcome(job.id, Outcome.NOT_RUN, ran.elapsed,
                                       reason=StartDecision.FINISHED, acked=acked))
            continue
        ok = final.status is Status.SUCCEEDED
        outcomes.append(JobOutcome(job.id, Outcome.SUCCEEDED if ok else Outcome.FAILED,
                                   ran.elapsed, len(out) if ok else 0, final.error,
                                   model_version=version, acked=acked))
        metrics.get().jobs.labels(model, final.status.value).inc()
        metrics.get().items.labels(model, final.status.value).inc(len(job.args.inputs))
        if final.error is not None or logger.isEnabledFor(logging.DEBUG):
            with trace(job.trace_id):
                logger.log(logging.WARNING if final.error else logging.DEBUG,
                           "job %s %s in %.3fs%s", job.id, final.status.value, ran.elapsed,
                           f": {final.error}" if final.error else "")
    return outcomes


def _log_batch(model: str, batch_id: str, jobs: list[BatchJob], elapsed: float,
               outcomes: list[JobOutcome]) -> None:
    """One line a batch, naming each job with its status and trace id: grep either id to find
    the batch that ran a job (a line a job, at DEBUG, would be thousands of lines a second)."""
    items = sum(len(job.args.inputs) for job in jobs)
    logger.info("batch %s of %s: %d job(s), %d item(s) in %.3fs: %s",
                batch_id, model, len(jobs), items, elapsed,
                ", ".join(f"{o.job_id} {o.outcome.value} trace_id={job.trace_id or '-'}"
                          for o, job in zip(outcomes, jobs)))
