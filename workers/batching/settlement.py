"""How a worker's jobs end in Celery's books and kombu's: per job Celery's own request handlers
(state, task events for Flower, `inspect`), and acknowledgements and requeues through the
worker's leases (workers/broker/leases.py), a batch's together in one round trip; none for the
messages that the child's finish acknowledged already, with their results (an outcome's
`acked`).

Results a child could not store (Redis refused them for longer than `redis_retry_s`) are kept
here and stored on a later tick, their messages held meanwhile: a job that ran is never run
again because Redis was full. A batch whose child was lost is settled by
workers/batching/isolation.py's rules: each job runs again alone, and only the one that loses its
child alone fails."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from time import monotonic, time
from typing import Any, Callable, Iterator

import redis
from billiard.einfo import ExceptionInfo, ExceptionWithTraceback
from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery.worker import state as worker_state

from tasks.errors import ErrorCode, JobError
from tasks.jobstate import JobState, StartDecision, Status
from tasks.logs import trace
from workers.child.batch import BatchJob, JobOutcome, Outcome, failed
from workers.broker import Leases
from workers.broker.events import send_task_events
from workers.batching.isolation import TimeLimits, Verdict, after_lost_batch

logger = logging.getLogger(__name__)


def _success(o: JobOutcome) -> str:
    """What Flower shows as a succeeded job's result: the outputs stay in Redis."""
    return f"{o.outputs} output(s), model_version {o.model_version}"


def _failure_info(error: JobError) -> ExceptionInfo:
    try:
        raise error
    except JobError:
        return ExceptionInfo()


class Settlement:
    """One per worker (`PoolDispatcher.settlement`). `app`: the worker's Celery app."""

    def __init__(self, app: Any, leases: Leases, state: JobState, limits: TimeLimits,
                 eventer: Callable[[], Any] = lambda: None) -> None:
        self.app = app
        # The worker's task event dispatcher now (Celery makes a new one on a reconnect).
        self.eventer = eventer
        self.limits = limits
        self.settings = app.conf.iq_settings
        self.leases = leases
        self.state = state
        self._settling: tuple[list, list] | None = None
        # Messages (by id) that the finish storing their results acknowledged in Redis: their
        # ack is Celery's and kombu's books only.
        self._acked: set[int] = set()
        # (request, outcome) of jobs that ran but whose result Redis refused: stored later.
        self.unstored: list[tuple[Any, JobOutcome]] = []

    def callbacks(self, message: Any) -> tuple[Any, Any]:
        """A request's ack and reject: through the leases, collected per batch."""
        def on_ack(_logger: Any = None, _errors: Any = None) -> None:
            self.settle(message, requeue=False)

        def on_reject(_logger: Any = None, _errors: Any = None, requeue: bool = False) -> None:
            self.settle(message, requeue=requeue)

        return on_ack, on_reject

    def settle(self, message: Any, requeue: bool) -> None:
        if not requeue and id(message) in self._acked:
            self._acked.discard(id(message))
            self.leases.settled([message])
        elif self._settling is not None:
            self._settling[1 if requeue else 0].append(message)
        elif requeue:
            self.leases.restore([message])
        else:
            self.leases.ack([message])

    @contextmanager
    def settling(self) -> Iterator[None]:
        """Acks and requeues made inside go to Redis together, in one round trip each."""
        if self._settling is not None:  # already inside one: the outer one settles
            yield
            return
        self._settling = ([], [])
        try:
            yield
        finally:
            acks, restores = self._settling
            self._settling = None
            self.leases.ack(acks)
            self.leases.restore(restores)

    def revoked(self, request: Any) -> bool:
        """Whether the job was revoked through Celery (`celery revoke`, Flower, the API's
        cancel): then Celery announces it (event, ack) and its record ends `cancelled`,
        unless it already ended otherwise."""
        if not request.revoked():
            return False
        try:
            self.state.cancel(request.id)
        except redis.RedisError:
            logger.error("job %s revoked and dropped, but Redis refused to mark its record "
                         "cancelled: the record stays queued", request.id)
        return True

    def _events(self, requests: list) -> Any:
        """The dispatcher to send these requests' task events through; None: none sent."""
        eventer = self.eventer()
        if eventer is None or not requests or not requests[0].task.send_events:
            return None
        return eventer

    def accepted(self, requests: list, pid: int, time_accepted: float) -> None:
        """A pool child took the batch: what Celery's `Request.on_accepted` does for each
        job (its pid and start in `inspect active`, Celery's books), with the batch's
        `task-started` events buffered together."""
        started = time() - (monotonic() - time_accepted)
        for r in requests:
            r.worker_pid, r.time_start = pid, started
            worker_state.task_accepted(r)
            if not r.task.acks_late:
                r.acknowledge()
        send_task_events(self._events(requests), "task-started",
                         [(r.id, {}) for r in requests])

    def finish(self, model: str, requests: list, outcomes: list[JobOutcome]) -> None:
        """A returned batch: each job's outcome into Celery's books, acks together; the
        succeeded jobs' `task-succeeded` events buffered together."""
        by_id = {o.job_id: o for o in outcomes}
        succeeded: list[tuple[str, dict]] = []
        settled: list = []  # succeeded jobs' messages the finish acknowledged in Redis already
        with self.settling():
            assert self._settling is not None
            acks = self._settling[0]  # this one's, or an outer one's: sent as it ends
            for r in requests:
                o = by_id.get(r.id)
                if o is None:
                    logger.error("batch of %s returned no outcome for job %s; requeued",
                                 model, r.id)
                    o = JobOutcome(r.id, Outcome.RETRY)
                if o.outcome is Outcome.SUCCEEDED:
                    # What `Request.on_success` does, its event left for the batch's, and what
                    # its `acknowledge` does (`settle`), the batch's acks together rather than
                    # through each request's `on_ack`. Not into Celery's `successful_requests`
                    # (a set that ages its entries, costly a job): in this process Celery reads
                    # it only for a request still active and unacknowledged, which this one,
                    # off the active books and acknowledged here, is not.
                    worker_state.task_ready(r)
                    if not r.acknowledged:
                        r.acknowledged = True
                        (settled if o.acked else acks).append(r.message)
                    succeeded.append((r.id, {"result": _success(o), "runtime": o.runtime}))
                    continue
                if o.acked:
                    self._acked.add(id(r.message))
                if o.outcome is Outcome.UNSTORED:
                    self.unstored.append((r, o))
                    continue
                try:
                    self._settle_one(r, o)
                except Exception:  # noqa: BLE001 - one job's bookkeeping must not stop the rest
                    logger.exception("bookkeeping of job %s failed", r.id)
                    if o.outcome is Outcome.RETRY or o.reason is StartDecision.LAPSED:
                        r.reject(requeue=True)  # not run here: its message must stay live
                    else:
                        r.acknowledge()
            self.leases.settled(settled)
        self._acked.clear()  # a request Celery's books had settled before, never acked again
        send_task_events(self._events(requests), "task-succeeded", succeeded)

    def _settle_one(self, r: Any, o: JobOutcome) -> None:
        """Celery's own handling of one job's outcome: state, event, ack or requeue."""
        if o.outcome is Outcome.SUCCEEDED:
            r.on_success((False, _success(o), o.runtime))
        elif o.outcome is Outcome.FAILED:
            r.on_success((True, _failure_info(o.error), o.runtime))
        elif o.outcome is Outcome.RETRY:
            worker_state.task_ready(r)
            r.reject(requeue=True)
        elif o.reason is StartDecision.LAPSED:
            # Its message was taken back while this worker's lease had lapsed: whoever took
            # it runs it. That may be this very worker: a fetch after the lapse can bring the
            # message back onto its own in-flight record, under the same tag, and the copy
            # it delivered was dropped as a duplicate while this request still held the tag
            # (the start, in the child, had already found the tag gone). Forgotten here, that
            # entry would be held by no one, yet leased by this live worker's beat: no
            # recovery and no reconciler would ever look at it, the job queued for good. So
            # whatever the record still has under the tag goes back to its queue (nothing,
            # when another worker holds it or it waits on its queue); a newer delivery held
            # under the tag (a copy that was kept) is left alone.
            worker_state.task_ready(r)
            self.settle(r.message, requeue=True)
        else:  # NOT_RUN: cancelled, expired, missing, or finished by an earlier run
            worker_state.task_ready(r)
            if o.reason in (StartDecision.CANCELLED, StartDecision.EXPIRED):
                r.send_event("task-revoked", terminated=False, signum=None,
                             expired=o.reason is StartDecision.EXPIRED)
            r.acknowledge()

    def store_kept(self) -> None:
        """Store the results Redis refused before; settle the jobs whose result it takes."""
        if not self.unstored:
            return
        kept, self.unstored = self.unstored, []
        try:
            written = self.state.finish([o.final for _r, o in kept],
                                        result_ttl_s=self.settings.result_ttl_s)
        except redis.RedisError as exc:
            logger.warning("Redis still refuses the results of %d job(s): %s", len(kept), exc)
            self.unstored = kept + self.unstored
            return
        with self.settling():
            for (r, o), fresh in zip(kept, written):
                final = o.final
                if not fresh:
                    o = JobOutcome(r.id, Outcome.NOT_RUN, reason=StartDecision.FINISHED)
                elif final.status is Status.SUCCEEDED:
                    o = JobOutcome(r.id, Outcome.SUCCEEDED, o.runtime)
                else:
                    o = JobOutcome(r.id, Outcome.FAILED, o.runtime, error=final.error)
                self._settle_one(r, o)
        logger.info("stored the results of %d job(s) kept while Redis refused them", len(kept))

    def give_back_unstored(self) -> None:
        """At a stop: results Redis still refuses are lost with this worker; their jobs go
        back on their queues (they will run again)."""
        self.store_kept()
        if self.unstored:
            logger.warning("stopping with %d result(s) Redis refused: their jobs go back on "
                           "their queues", len(self.unstored))
            with self.settling():
                for r, _o in self.unstored:
                    worker_state.task_ready(r)
                    r.reject(requeue=True)
            self.unstored = []

    def failed_batch(self, model: str, requests: list, exc_info: ExceptionInfo,
                     stopping: bool = False) -> list:
        """The batch call did not return: its child died, or was killed at its time limit,
        or the call itself broke. Returns the requests to run again, each alone."""
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        # A cold shutdown (SIGQUIT, a second Ctrl-C) terminates the pool: its running batch
        # ends `Terminated`, not lost, and is no more its jobs' fault than a warm stop's kill.
        lost = (WorkerLostError, TimeLimitExceeded, Terminated) if stopping else \
            (WorkerLostError, TimeLimitExceeded)
        if not isinstance(exc, lost):
            self.fail(requests, JobError(ErrorCode.WORKER_ERROR, f"{type(exc).__name__}: {exc}"))
            return []
        if stopping:  # stopped by this worker's own stop: back to the queues, no one's fault
            with self.settling():
                for r in requests:
                    worker_state.task_ready(r)
                    r.reject(requeue=True)
            return []
        timed_out = isinstance(exc, TimeLimitExceeded)
        crashes = None if timed_out else self._count_crash(requests)
        again: list = []
        failing: dict[Verdict, list] = {}
        for i, r in enumerate(requests):
            verdict = after_lost_batch(len(requests), timed_out,
                                       crashes[i] if crashes else None,
                                       self.settings.max_job_crashes)
            (again if verdict is Verdict.ALONE else failing.setdefault(verdict, [])).append(r)
        for verdict, failed_requests in failing.items():
            self.fail(failed_requests, self._lost_error(model, verdict))
        for r in again:
            worker_state.task_ready(r)
        if again and len(requests) > 1:
            logger.warning("batch of %s lost its child (%s): its %d job(s) run again, each "
                           "alone", model, type(exc).__name__, len(again))
        return again

    def _count_crash(self, requests: list) -> list[int] | None:
        try:
            return self.state.crashed([r.id for r in requests])
        except redis.RedisError as exc:
            logger.warning("could not count a lost child against %d job(s): %s",
                           len(requests), exc)
            return None

    def _lost_error(self, model: str, verdict: Verdict) -> JobError:
        if verdict is Verdict.TIMEOUT:
            return JobError(ErrorCode.TIMEOUT, "the job ran past its model's time limit "
                            f"({self.limits.limit(model):g} s), alone in its batch")
        return JobError(ErrorCode.CRASHED, "the model's process died running this job "
                        f"{self.settings.max_job_crashes} times, the last time alone in its "
                        "batch")

    def fail(self, requests: list, error: JobError) -> None:
        """These jobs end failed with `error` without a result of their model's (a batch
        that never returned, a model a reload removed); kept and stored later if Redis
        refuses."""
        jobs = [BatchJob.of(r) for r in requests]
        finals = [failed(self.app, job, error) for job in jobs]
        for job in jobs:
            with trace(job.trace_id):
                logger.warning("job %s failed: %s", job.id, error)
        try:
            written = self.state.finish(finals, result_ttl_s=self.settings.result_ttl_s)
        except redis.RedisError:
            logger.warning("could not store the failure of %d job(s) yet; kept", len(requests),
                           exc_info=True)
            self.unstored += [(r, JobOutcome(r.id, Outcome.UNSTORED, final=f))
                              for r, f in zip(requests, finals)]
            return
        with self.settling():
            for r, fresh in zip(requests, written):
                self._settle_one(r, JobOutcome(r.id, Outcome.FAILED, error=error) if fresh
                                 else JobOutcome(r.id, Outcome.NOT_RUN,
                                                 reason=StartDecision.FINISHED))
