"""How a worker's jobs end in Celery's books and kombu's: per job Celery's own request handlers
(state, task events for Flower, `inspect`), and acknowledgements and requeues through the
worker's leases (workers/broker/leases.py), a batch's together in one round trip."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator

import redis
from billiard.einfo import ExceptionInfo, ExceptionWithTraceback
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker import state as worker_state

from tasks.errors import ErrorCode, JobError
from tasks.jobstate import JobState, StartDecision
from tasks.logs import trace
from workers.batch import BatchJob, JobOutcome, Outcome, failed
from workers.broker import Leases

logger = logging.getLogger(__name__)


def _failure_info(error: JobError) -> ExceptionInfo:
    try:
        raise error
    except JobError:
        return ExceptionInfo()


class Settlement:
    """One per worker (`PoolDispatcher.settlement`). `app`: the worker's Celery app."""

    def __init__(self, app: Any, leases: Leases, state: JobState) -> None:
        self.app = app
        self.settings = app.conf.iq_settings
        self.leases = leases
        self.state = state
        self._settling: tuple[list, list] | None = None

    def callbacks(self, message: Any) -> tuple[Any, Any]:
        """A request's ack and reject: through the leases, collected per batch."""
        def on_ack(_logger: Any = None, _errors: Any = None) -> None:
            self._settle(message, requeue=False)

        def on_reject(_logger: Any = None, _errors: Any = None, requeue: bool = False) -> None:
            self._settle(message, requeue=requeue)

        return on_ack, on_reject

    def _settle(self, message: Any, requeue: bool) -> None:
        if self._settling is not None:
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

    def finish(self, model: str, requests: list, outcomes: list[JobOutcome]) -> None:
        """A returned batch: each job's outcome into Celery's books, acks together."""
        by_id = {o.job_id: o for o in outcomes}
        with self.settling():
            for r in requests:
                o = by_id.get(r.id)
                if o is None:
                    logger.error("batch of %s returned no outcome for job %s; requeued",
                                 model, r.id)
                    o = JobOutcome(r.id, Outcome.RETRY)
                try:
                    self._settle_one(r, o)
                except Exception:  # noqa: BLE001 - one job's bookkeeping must not stop the rest
                    logger.exception("bookkeeping of job %s failed", r.id)
                    r.acknowledge() if o.outcome is not Outcome.RETRY else r.reject(requeue=True)

    @staticmethod
    def _settle_one(r: Any, o: JobOutcome) -> None:
        """Celery's own handling of one job's outcome: state, event, ack or requeue."""
        if o.outcome is Outcome.SUCCEEDED:
            # What Flower shows as the task's result: the outputs stay in Redis.
            r.on_success((False, f"{o.outputs} output(s), model_version {o.model_version}",
                          o.runtime))
        elif o.outcome is Outcome.FAILED:
            r.on_success((True, _failure_info(o.error), o.runtime))
        elif o.outcome is Outcome.RETRY:
            worker_state.task_ready(r)
            r.reject(requeue=True)
        else:  # NOT_RUN: cancelled, expired, missing, or finished by an earlier run
            worker_state.task_ready(r)
            if o.reason in (StartDecision.CANCELLED, StartDecision.EXPIRED):
                r.send_event("task-revoked", terminated=False, signum=None,
                             expired=o.reason is StartDecision.EXPIRED)
            r.acknowledge()

    def failed_batch(self, model: str, requests: list, exc_info: ExceptionInfo) -> None:
        """The batch call did not return: its child died, or was killed at the time limit,
        or the call itself broke."""
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, WorkerLostError):
            # Celery's own path: each job back on its queue (reject_on_worker_lost), unless
            # its success was stored before the child went.
            with self.settling():
                for r in requests:
                    r.on_failure(exc_info)
            return
        self.fail(requests, self._batch_error(model, exc), exc_info)

    def fail(self, requests: list, error: JobError, exc_info: ExceptionInfo | None = None) -> None:
        """Jobs that end `failed` with `error` without a result of their model's (a batch
        that never returned, a model a reload removed): stored, then acknowledged, with
        their task events; requeued instead when Redis refuses the store."""
        exc_info = exc_info or _failure_info(error)
        jobs = [BatchJob.of(r) for r in requests]
        finals = [failed(self.app, job, error) for job in jobs]
        try:
            self.state.finish(finals, result_ttl_s=self.settings.result_ttl_s)
        except redis.RedisError:
            logger.warning("could not store the failure of %d job(s); requeued", len(requests),
                           exc_info=True)
            with self.settling():
                for r in requests:
                    worker_state.task_ready(r)
                    r.reject(requeue=True)
            return
        for job in jobs:
            with trace(job.trace_id):
                logger.warning("job %s failed: %s", job.id, error)
        with self.settling():
            for r in requests:
                r.on_failure(exc_info, return_ok=True)  # stored above: only ack and event

    def _batch_error(self, model: str, exc: BaseException) -> JobError:
        if isinstance(exc, TimeLimitExceeded):
            spec = self.app.conf.iq_models.get(model)  # a reload may have removed it
            limit = spec.time_limit_s if spec else 0
            return JobError(ErrorCode.TIMEOUT,
                            f"the batch ran past its model's time limit ({limit:g} s)")
        return JobError(ErrorCode.WORKER_ERROR, f"{type(exc).__name__}: {exc}")
