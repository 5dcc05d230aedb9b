"""Celery glue for dynamic batching: a task Strategy that buffers requests in the worker's main
process and hands each batch, as one call, to a prefork pool child; and a consumer bootstep
that keeps what the worker holds leased, tells the API the worker is consuming, and restarts
the worker when its event loop stops.

Each job keeps its Celery identity: it is a real `celery.worker.request.Request`, so Celery's
own handlers do the bookkeeping per job: `inspect reserved/active`, task events for Flower
(received, started, succeeded/failed with runtime), revocation, late acks, and requeueing
when the child running it dies (`task_reject_on_worker_lost`). Acknowledging goes through the
worker's leases (workers/leases.py), a batch at a time.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from time import monotonic
from typing import Any, Iterator

import redis
from billiard.einfo import ExceptionInfo, ExceptionWithTraceback
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import bootsteps
from celery.utils.imports import symbol_by_name
from celery.worker import state as worker_state
from celery.worker.strategy import proto1_to_proto2

from config import ConfigError
from tasks import transport
from tasks.errors import JobFailed
from tasks.jobstate import Final, JobError, JobState, Status
from tasks.keys import CONSUMING_KEY
from tasks.logs import trace
from tasks.names import PRIORITIES, model_of_task, queue_lists
from tasks.redis_client import connect
from workers.devices import visible_gpu_count
from workers.execute import JobOutcome, Outcome, run_batch, webhook_message
from workers.leases import Leases
from workers.policy import Batch, BatchScheduler
from workers.watchdog import Watchdog

logger = logging.getLogger(__name__)

_DISPATCHER_ATTR = "_iq_dispatcher"


def _failure_info(error: JobError) -> ExceptionInfo:
    try:
        raise JobFailed(error.code, error.message)
    except JobFailed:
        return ExceptionInfo()


def _stopping() -> bool:
    # Celery sets these to the exit code, 0 included, when a shutdown starts.
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


_TRACE_HEADERS = ("trace_id", "traceparent", "tracestate")


def trace_headers(request: Any) -> dict[str, str]:
    """The job's trace id and W3C trace context, from its message headers."""
    found = request.request_dict
    nested = found.get("headers") or {}
    return {k: found.get(k) or nested.get(k) for k in _TRACE_HEADERS
            if found.get(k) or nested.get(k)}


def trace_id_of(request: Any) -> str | None:
    return trace_headers(request).get("trace_id")


class PoolDispatcher:
    """One per worker: buffers every batching task's requests and feeds the pool."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.settings = consumer.app.conf.iq_settings
        self.scheduler = BatchScheduler()
        self.inflight = 0
        self.connection = consumer.connection
        self.client = connect(self.settings.redis_url, self.settings)
        self.leases = Leases(transport.Unacked(self.client))
        self.state = JobState(self.client)
        self.watchdog = Watchdog(self.settings.watchdog_s, self)
        self.consuming = False
        self._timer_entry: Any = None
        self._timer_due: float | None = None
        self._settling: tuple[list, list] | None = None

    # -- bookkeeping ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return int(self.consumer.pool.num_processes or 1)

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
        with self.settling():
            batches = self.scheduler.batches(monotonic(), idle=idle, busy=self.inflight,
                                             freed=freed, discard=self.revoked)
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
        requests = [p.job for p in batch.jobs]
        payload = [(r.id, r.kwargs or {}, trace_headers(r)) for r in requests]
        self.inflight += 1

        def on_accepted(pid: int, time_accepted: float) -> None:
            for r in requests:
                r.on_accepted(pid, time_accepted)

        def on_return(outcomes: list[JobOutcome]) -> None:
            self.inflight -= 1
            if _stopping():
                # Shutting down: the loop may not turn again, and no new batch starts.
                self._finish(batch.model, requests, outcomes)
                return
            self.pump(freed=1)
            # The pool writes the freed child its next batch only when the event loop next
            # turns. Acknowledging now (a Redis round trip and an event per job) would hold
            # that batch back for all of it, the model idle meanwhile; so the bookkeeping
            # waits a millisecond, past that write (results are stored already).
            self.consumer.timer.call_after(0.001, self._finish, (batch.model, requests, outcomes))

        def on_error(exc_info: ExceptionInfo) -> None:
            self.inflight -= 1
            self._failed_batch(batch.model, requests, exc_info)
            if not _stopping():
                self.pump(freed=1)

        time_limit = self.consumer.app.conf.iq_models[batch.model].time_limit_s or None
        self.consumer.pool.apply_async(
            run_batch,
            args=(batch.model, payload),
            accept_callback=on_accepted,
            callback=on_return,
            error_callback=on_error,
            # Past the hard limit the child is killed and replaced; each job of the batch
            # ends failed with code `timeout` (_failed_batch).
            timeout=time_limit,
            correlation_id=requests[0].id,
        )

    def _finish(self, model: str, requests: list, outcomes: list[JobOutcome]) -> None:
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
            r.on_success((False, f"{o.outputs} output(s)", o.runtime))
        elif o.outcome is Outcome.FAILED:
            r.on_success((True, _failure_info(o.error), o.runtime))
        elif o.outcome is Outcome.RETRY:
            worker_state.task_ready(r)
            r.reject(requeue=True)
        else:  # NOT_RUN: cancelled, expired, missing, or finished by an earlier run
            worker_state.task_ready(r)
            if o.reason in ("cancelled", "expired"):
                r.send_event("task-revoked", terminated=False, signum=None,
                             expired=o.reason == "expired")
            r.acknowledge()

    def _failed_batch(self, model: str, requests: list, exc_info: ExceptionInfo) -> None:
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
        spec = self.consumer.app.conf.iq_models[model]
        if isinstance(exc, TimeLimitExceeded):
            error = JobError("timeout", f"the batch ran past its model's time limit "
                                        f"({spec.time_limit_s:g} s)")
        else:
            error = JobError("worker_error", f"{type(exc).__name__}: {exc}")
        app = self.consumer.app
        finals = [Final(r.id, Status.FAILED,
                        transport.result_meta(app, r.id, Status.FAILED,
                                              JobFailed(error.code, error.message)),
                        error, webhook_message(app, r.id, r.kwargs or {}, trace_id_of(r),
                                               Status.FAILED))
                  for r in requests]
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
        for r in requests:
            with trace(trace_id_of(r)):
                logger.warning("job %s failed: %s: %s", r.id, error.code, error.message)
        with self.settling():
            for r in requests:
                r.on_failure(exc_info, return_ok=True)  # stored above: only ack and event

    # -- the periodic tick: leases, liveness, watchdog -------------------------------------
    def tick(self) -> None:
        self.leases.tick()
        self.watchdog.beat()
        for queue in self.unknown_queues():  # added at run time (`control add_consumer`)
            logger.error("queue %s belongs to no model in %s: stopped consuming it, so that "
                         "its jobs wait for a worker that has the model", queue,
                         self.settings.models_file)
            self.consumer.cancel_task_queue(queue)
        queues = self.consumed_queues()
        if not queues:  # no model's queue (a webhooks-only worker, or all cancelled)
            return
        stalled = self.inflight < self.capacity and len(self.scheduler) == 0 \
            and self._jobs_waiting(queues)
        self.watchdog.observe_idle_with_work(stalled)
        try:
            if self.consuming:
                self.client.zadd(CONSUMING_KEY, {self.consumer.hostname: time.time()})
        except redis.RedisError as exc:
            logger.warning("could not announce this worker as consuming: %s", exc)

    def unknown_queues(self) -> list[str]:
        """Queues this worker consumes that no model of its models file uses: Celery would
        take their messages as unregistered tasks and drop them."""
        task_consumer = getattr(self.consumer, "task_consumer", None)
        models = {spec.queue for spec in self.consumer.app.conf.iq_models.values()}
        return sorted(q.name for q in (task_consumer.queues if task_consumer else [])
                      if q.name not in models)

    def consumed_queues(self) -> list[str]:
        """The model queues this worker consumes now (`add_consumer`/`cancel_consumer` change
        them at run time)."""
        task_consumer = getattr(self.consumer, "task_consumer", None)
        models = {spec.queue for spec in self.consumer.app.conf.iq_models.values()}
        return [q.name for q in (task_consumer.queues if task_consumer else [])
                if q.name in models]

    def _jobs_waiting(self, queues: list[str]) -> bool:
        """Whether any of these queues has messages waiting in Redis."""
        lists = [name for q in queues for name in queue_lists(q)]
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for name in lists:
                    pipe.llen(name)
                return sum(pipe.execute()) > 0
        except redis.RedisError:
            return False

    def stop_consuming(self) -> None:
        self.consuming = False
        try:
            self.client.zrem(CONSUMING_KEY, self.consumer.hostname)
        except redis.RedisError:
            pass

    def pool_pids(self) -> list[int]:
        try:
            return list(self.consumer.pool.info.get("processes") or [])
        except Exception:  # noqa: BLE001 - the pool may be half torn down
            return []


class DispatcherStep(bootsteps.StartStopStep):
    """A consumer bootstep: started after each (re)connection, once the task strategies (and
    so the dispatcher) exist; stopped before the connection goes, on a reconnect and at
    shutdown."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self._tick: Any = None

    def start(self, c: Any) -> None:
        dispatcher = getattr(c, _DISPATCHER_ATTR, None)
        if dispatcher is None:
            return
        unknown = dispatcher.unknown_queues()
        if unknown:
            # Before the event loop runs, so nothing has been fetched (and dropped) yet.
            raise ConfigError(
                f"this worker consumes {', '.join(unknown)}, which no model in its models "
                f"file ({dispatcher.settings.models_file}) uses: their jobs would be dropped. "
                "Consume only its models' queues (IQ_WORKER_QUEUES, -Q), or give it the "
                "models file that declares them")
        dispatcher.consuming = True
        dispatcher.tick()
        self._tick = c.timer.call_repeatedly(dispatcher.settings.heartbeat_interval_s,
                                             dispatcher.tick)
        dispatcher.watchdog.start()

    def stop(self, c: Any) -> None:
        """Consuming ends: on a reconnect (`stop`), at a warm shutdown (`close`, before the
        pool finishes its running batches) and at the end (`shutdown`). What waits in the
        buffer goes back to its queue now rather than after a visibility timeout."""
        dispatcher = getattr(c, _DISPATCHER_ATTR, None)
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        if dispatcher is not None:
            dispatcher.watchdog.pause()
            dispatcher.stop_consuming()
            dispatcher.release_buffered("stopped consuming")

    close = shutdown = stop


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


def keep_batches_through_reconnects(pool: Any) -> None:
    """When the broker connection goes, Celery flushes the pool (`Consumer.on_close`): it
    discards every job no child has accepted yet and clears what waits to be written to a
    child, because the broker will redeliver those messages. Here every pool job is a batch
    whose messages the dispatcher holds by their leases, which kombu does not restore
    (tasks/transport.py), so nothing would redeliver them: a batch discarded in the
    milliseconds between its hand-over and its child's acceptance never came back, and the
    dispatcher counted that child busy for good, so the worker took no more work. The flush
    is skipped: batches in flight are written, run and settled as after any reconnect."""
    if not getattr(pool, "_iq_keeps_batches", False):
        pool.flush = _keep_every_batch
        pool._iq_keeps_batches = True


def _keep_every_batch() -> None:
    """The pool's flush on a reconnect: nothing to drop (keep_batches_through_reconnects)."""


def dispatcher_for(consumer: Any) -> PoolDispatcher:
    dispatcher = getattr(consumer, _DISPATCHER_ATTR, None)
    if dispatcher is None:
        dispatcher = PoolDispatcher(consumer)
        setattr(consumer, _DISPATCHER_ATTR, dispatcher)
        guard_pool_growth(consumer.pool, visible_gpu_count(dispatcher.settings))
        keep_batches_through_reconnects(consumer.pool)
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

    def task_message_handler(message, body, _ack, _reject, callbacks, **_kw):
        if body is None and "args" not in message.payload:
            body, headers, decoded, utc = (message.body, message.headers, False,
                                           app.uses_utc_timezone())
        else:
            body, headers, decoded, utc = proto1_to_proto2(message, body)
        on_ack, on_reject = dispatcher.callbacks(message)
        request = Request(
            message, on_ack=on_ack, on_reject=on_reject, app=app, hostname=hostname,
            eventer=eventer, task=task, connection_errors=connection_errors,
            body=body, headers=headers, decoded=decoded, utc=utc,
        )
        dispatcher.leases.hold(message)
        if (request.expires or request.id in revoked_tasks) and dispatcher.revoked(request):
            return
        if send_events:
            request.send_event("task-received", name=request.name, args=request.argsrepr,
                               kwargs=request.kwargsrepr, root_id=request.root_id,
                               parent_id=request.parent_id, retries=0)
        if callbacks:
            for callback in callbacks:
                callback(request)
        if logger.isEnabledFor(logging.DEBUG):  # one INFO line a batch, in the child
            with trace(trace_id_of(request)):
                logger.debug("job %s received: model=%s", request.id, model)
        dispatcher.submit(model, request)

    return task_message_handler
