"""The worker's dispatcher, in its main process: intake and batching. Every batching task's
requests wait in one buffer per model (workers/policy.py decides when a batch leaves); each
batch goes, as one call, to a free prefork pool child (workers/execute.py). How its jobs then
end is the settlement's (workers/settlement.py); the periodic tick is the liveness's
(workers/liveness.py). Celery hands it requests through the task Strategy
(workers/strategy.py).

Each job keeps its Celery identity: it is a real `celery.worker.request.Request`, so Celery's
own handlers do the bookkeeping per job: `inspect reserved/active`, task events for Flower
(received, started, succeeded/failed with runtime), revocation, late acks, and requeueing
when the child running it dies (`task_reject_on_worker_lost`).
"""
from __future__ import annotations

import logging
from time import monotonic
from typing import Any

from billiard.einfo import ExceptionInfo
from celery.worker import state as worker_state

from tasks.jobstate import JobState
from tasks.names import PRIORITIES
from tasks.redis_client import connect
from workers.batch import BatchJob, JobOutcome
from workers.broker import Leases, Unacked, broker_of
from workers.execute import run_batch
from workers.liveness import Liveness
from workers.policy import Batch, BatchScheduler
from workers.settlement import Settlement

logger = logging.getLogger(__name__)


def _stopping() -> bool:
    # Celery sets these to the exit code, 0 included, when a shutdown starts.
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


class PoolDispatcher:
    """One per worker: buffers every batching task's requests and feeds the pool."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.settings = consumer.app.conf.iq_settings
        self.scheduler = BatchScheduler()
        self.inflight = 0
        self.connection = consumer.connection
        self.client = connect(self.settings.redis_url, self.settings)
        self.leases = Leases(Unacked(self.client, broker_of(consumer.app)))
        self.settlement = Settlement(consumer.app, self.leases, JobState(
            self.client, self.settings.kept_s, self.settings.job_ttl_s))
        self.liveness = Liveness(consumer, self.client, self.leases, self._idle)
        self._timer_entry: Any = None
        self._timer_due: float | None = None

    @property
    def capacity(self) -> int:
        return int(self.consumer.pool.num_processes or 1)

    def _idle(self) -> bool:
        """A pool child is free and nothing waits in the buffer."""
        return self.inflight < self.capacity and len(self.scheduler) == 0

    def reset_for(self, connection: Any) -> None:
        """After a broker reconnect: what waited in the buffer goes back to its queue at once
        (another worker may take it); batches still running stay this worker's, and their
        acknowledgements go through its own Redis client."""
        if connection is self.connection:
            return
        self.connection = connection
        self.release_buffered("broker connection replaced")

    def release_buffered(self, why: str) -> None:
        drained = self.scheduler.drain()
        for pending in drained:
            worker_state.task_ready(pending.job)
        if drained:
            self.leases.restore([p.job.message for p in drained])
            logger.warning("%s: %d buffered job(s) back on their queues", why, len(drained))

    # -- intake --------------------------------------------------------------------------
    def submit(self, model: str, request: Any) -> None:
        kwargs = request.kwargs or {}
        inputs = kwargs.get("inputs")
        items = len(inputs) if isinstance(inputs, list) else 1
        priority = (request.delivery_info or {}).get("priority")
        worker_state.task_reserved(request)
        self.scheduler.add(model, request, items, monotonic(),
                           priority=PRIORITIES["normal"] if priority is None else int(priority))
        self.pump()

    # -- batching ------------------------------------------------------------------------
    def pump(self, freed: int = 0) -> None:
        idle = self.capacity - self.inflight
        with self.settlement.settling():
            batches = self.scheduler.batches(monotonic(), idle=idle, busy=self.inflight,
                                             freed=freed, discard=self.settlement.revoked)
        for batch in batches:
            self._apply(batch)
        self._arm_timer()

    def _arm_timer(self) -> None:
        due = self.scheduler.next_deadline() if self.inflight < self.capacity else None
        if due == self._timer_due:
            return
        if self._timer_entry is not None:
            self._timer_entry.cancel()
            self._timer_entry = None
        self._timer_due = due
        if due is not None:
            self._timer_entry = self.consumer.timer.call_after(
                max(due - monotonic(), 0.0), self._on_timer
            )

    def _on_timer(self) -> None:
        self._timer_entry = None
        self._timer_due = None
        self.pump()

    def _apply(self, batch: Batch) -> None:
        """The batch to a free child, as one call; its outcomes come back to `_returned`."""
        requests = [p.job for p in batch.jobs]
        self.inflight += 1

        def on_accepted(pid: int, time_accepted: float) -> None:
            for r in requests:
                r.on_accepted(pid, time_accepted)

        def on_return(outcomes: list[JobOutcome]) -> None:
            self._returned(batch.model, requests, outcomes)

        def on_error(exc_info: ExceptionInfo) -> None:
            self.inflight -= 1
            self.settlement.failed_batch(batch.model, requests, exc_info)
            if not _stopping():
                self.pump(freed=1)

        time_limit = self.consumer.app.conf.iq_models[batch.model].time_limit_s or None
        self.consumer.pool.apply_async(
            run_batch,
            args=(batch.model, [BatchJob.of(r) for r in requests]),
            accept_callback=on_accepted,
            callback=on_return,
            error_callback=on_error,
            # Past the hard limit the child is killed and replaced; each job of the batch
            # ends failed with code `timeout` (Settlement.failed_batch).
            timeout=time_limit,
            correlation_id=requests[0].id,
        )

    def _returned(self, model: str, requests: list, outcomes: list[JobOutcome]) -> None:
        self.inflight -= 1
        if _stopping():
            # Shutting down: the loop may not turn again, and no new batch starts.
            self.settlement.finish(model, requests, outcomes)
            return
        self.pump(freed=1)
        # The pool writes the freed child its next batch only when the event loop next
        # turns. Acknowledging now (a Redis round trip and an event per job) would hold that
        # batch back for all of it, the model idle meanwhile; so the bookkeeping waits a
        # millisecond, past that write (results are stored already).
        self.consumer.timer.call_after(0.001, self.settlement.finish, (model, requests, outcomes))
