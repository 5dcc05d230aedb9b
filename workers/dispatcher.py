"""Celery glue for dynamic batching: a task Strategy that buffers requests in the worker's main
process and hands each batch, as one call, to a prefork pool child.

Each job keeps its Celery identity: it is a real `celery.worker.request.Request`, so Celery's
own handlers do the bookkeeping per job: `inspect reserved/active`, task events for Flower
(received, started, succeeded/failed with runtime), revocation and expiry, late acks, and
requeueing when the child running it dies (`task_reject_on_worker_lost`).
"""
from __future__ import annotations

import logging
from time import monotonic
from typing import Any

from billiard.einfo import ExceptionInfo
from celery.utils.imports import symbol_by_name
from celery.worker import state as worker_state
from celery.worker.strategy import proto1_to_proto2

from tasks.errors import JobFailed
from tasks.logs import trace
from tasks.names import PRIORITIES, model_of_task
from workers.devices import visible_gpu_count
from workers.execute import CANCELLED, JobOutcome, run_batch
from workers.policy import Batch, BatchScheduler

logger = logging.getLogger(__name__)

_DISPATCHER_ATTR = "_iq_dispatcher"


def _failure_info(code: str, message: str) -> ExceptionInfo:
    try:
        raise JobFailed(code, message)
    except JobFailed:
        return ExceptionInfo()


def trace_id_of(request: Any) -> str | None:
    return request.request_dict.get("trace_id") or \
        (request.request_dict.get("headers") or {}).get("trace_id")


def _stale(request: Any) -> bool:
    """The message came over a broker connection that has since been replaced: it can be
    neither acknowledged nor rejected any more (kombu fails on the closed channel). Redis
    still holds it as unacknowledged and delivers it again after the visibility timeout;
    a result already stored is kept (workers.execute.store_results)."""
    channel = getattr(request.message, "channel", None)
    return channel is None or bool(getattr(channel, "closed", False)) \
        or getattr(channel, "connection", None) is None


def _discard(request: Any) -> bool:
    # Request.revoked() also announces the revocation (result REVOKED, event, ack).
    return bool(request.revoked())


class PoolDispatcher:
    """One per worker consumer: buffers every batching task's requests and feeds the pool."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.scheduler = BatchScheduler()
        self.inflight = 0
        self.connection = consumer.connection
        self._timer_entry: Any = None
        self._timer_due: float | None = None

    # -- bookkeeping ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return int(self.consumer.pool.num_processes or 1)

    def reset_for(self, connection: Any) -> None:
        """After a broker reconnect the buffered messages belong to the old channel; Redis
        redelivers them, so the copies held here are dropped."""
        if connection is self.connection:
            return
        dropped = self.scheduler.drain()
        for pending in dropped:
            worker_state.task_ready(pending.job)
        if dropped:
            logger.warning("broker connection replaced: dropped %d buffered job(s) for "
                           "redelivery", len(dropped))
        self.connection = connection

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

    # -- dispatch ------------------------------------------------------------------------
    def pump(self, freed: int = 0) -> None:
        idle = self.capacity - self.inflight
        for batch in self.scheduler.batches(
            monotonic(), idle=idle, busy=self.inflight, freed=freed, discard=_discard
        ):
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
        requests = [p.job for p in batch.jobs]
        payload = [(r.id, r.kwargs or {}, trace_id_of(r)) for r in requests]
        self.inflight += 1

        def on_accepted(pid: int, time_accepted: float) -> None:
            for r in requests:
                r.on_accepted(pid, time_accepted)

        def on_return(outcomes: list[JobOutcome]) -> None:
            self.inflight -= 1
            self.pump(freed=1)
            # The pool writes the freed child its next batch only when the event loop next
            # turns. Acknowledging now (a Redis round trip and an event per job) would hold
            # that batch back for all of it, the model idle meanwhile; so the bookkeeping
            # waits a millisecond, past that write (results are stored already). Not while
            # shutting down: the loop may not turn again.
            if worker_state.should_stop or worker_state.should_terminate:
                finish(outcomes)
            else:
                self.consumer.timer.call_after(0.001, finish, (outcomes,))

        def finish(outcomes: list[JobOutcome]) -> None:
            by_id = {o[0]: o for o in outcomes}
            for r in requests:
                if _stale(r):
                    worker_state.task_ready(r)
                    continue
                outcome = by_id.get(r.id)
                if outcome is None:
                    r.on_failure(_failure_info("internal", "batch returned no outcome for job"))
                    continue
                _job_id, ok, runtime, summary = outcome
                if summary == CANCELLED:
                    # Cancelled through the API after it was buffered: never ran.
                    worker_state.task_ready(r)
                    r.send_event("task-revoked", terminated=False, signum=None, expired=False)
                    r.acknowledge()
                elif ok:
                    r.on_success((False, summary, runtime))
                else:
                    code, _, message = summary.partition(": ")
                    r.on_success((True, _failure_info(code, message), runtime))

        def on_error(exc_info: ExceptionInfo) -> None:
            # The child died (WorkerLostError: requeued by Celery) or the batch call itself
            # broke: each job takes Celery's own failure path.
            self.inflight -= 1
            for r in requests:
                if _stale(r):
                    worker_state.task_ready(r)
                    continue
                r.on_failure(exc_info)
            self.pump(freed=1)

        time_limit = self.consumer.app.conf.iq_models[batch.model].time_limit_s or None
        self.consumer.pool.apply_async(
            run_batch,
            args=(batch.model, payload),
            accept_callback=on_accepted,
            callback=on_return,
            error_callback=on_error,
            # Past the hard limit the child is killed and replaced; each job of the batch
            # takes Celery's timeout path (failed, TimeLimitExceeded, acknowledged).
            timeout=time_limit,
            correlation_id=requests[0].id,
        )


def guard_pool_growth(pool: Any, gpus: int) -> None:
    """One pool child per GPU: growing the pool past the host's GPU count (`celery control
    pool_grow`, autoscale) is refused with a log message. No limit on a CPU-only host."""
    if gpus <= 0 or getattr(pool, "_iq_guarded", False):
        return
    grow = pool.grow

    def guarded_grow(n: int = 1) -> Any:
        if pool.num_processes + n > gpus:
            logger.error("refusing to grow the pool from %d to %d children: this host has %d "
                         "GPU(s) and each child owns one; add a worker host instead",
                         pool.num_processes, pool.num_processes + n, gpus)
            return None
        return grow(n)

    pool.grow = guarded_grow
    pool._iq_guarded = True


def dispatcher_for(consumer: Any) -> PoolDispatcher:
    dispatcher = getattr(consumer, _DISPATCHER_ATTR, None)
    if dispatcher is None:
        dispatcher = PoolDispatcher(consumer)
        setattr(consumer, _DISPATCHER_ATTR, dispatcher)
        guard_pool_growth(consumer.pool, visible_gpu_count())
    else:
        dispatcher.reset_for(consumer.connection)
    return dispatcher


def batching_strategy(task: Any, app: Any, consumer: Any, **_kw: Any):
    """`Task.Strategy` for batching tasks: called once per task when the consumer starts."""
    model = model_of_task(task.name)
    spec = app.conf.iq_models[model]
    dispatcher = dispatcher_for(consumer)
    dispatcher.scheduler.add_model(model, spec.max_batch_size, spec.max_wait_ms / 1000.0)

    Request = symbol_by_name(task.Request)
    hostname = consumer.hostname
    eventer = consumer.event_dispatcher
    send_events = bool(eventer and eventer.enabled and task.send_events)
    connection_errors = consumer.connection_errors
    revoked_tasks = consumer.controller.state.revoked

    def task_message_handler(message, body, ack, reject, callbacks, **_kw):
        if body is None and "args" not in message.payload:
            body, headers, decoded, utc = (message.body, message.headers, False,
                                           app.uses_utc_timezone())
        else:
            body, headers, decoded, utc = proto1_to_proto2(message, body)
        request = Request(
            message, on_ack=ack, on_reject=reject, app=app, hostname=hostname,
            eventer=eventer, task=task, connection_errors=connection_errors,
            body=body, headers=headers, decoded=decoded, utc=utc,
        )
        if (request.expires or request.id in revoked_tasks) and request.revoked():
            return
        if send_events:
            request.send_event("task-received", name=request.name, args=request.argsrepr,
                               kwargs=request.kwargsrepr, root_id=request.root_id,
                               parent_id=request.parent_id, retries=0)
        if callbacks:
            for callback in callbacks:
                callback(request)
        with trace(trace_id_of(request)):
            logger.info("job %s received: model=%s", request.id, model)
        dispatcher.submit(model, request)

    return task_message_handler
