"""Where Celery hands the dispatcher its work: the batching tasks' `Task.Strategy` (each
received message becomes a job, workers/batching/job.py, whose Celery `Request` is built only
where something asks for it; held by the worker's leases and handed to the dispatcher's
buffer; a fetch's messages taken in one call, its `intake`, by the worker's consumer,
workers/broker/intake.py) and a consumer bootstep that starts and stops the dispatcher's tick
with each broker connection."""
from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.exceptions import InvalidTaskError
from celery.worker.strategy import proto1_to_proto2

from config import ConfigError
from tasks.logs import trace
from tasks.names import model_of_task
from workers.child.batch import trace_headers
from workers.broker.decode import payload
from workers.broker.intake import REFUSED, Refused
from workers.broker.pool import TaskPool, hold_ahead, on_child_ready
from workers.child.devices import pool_children
from workers.batching.dispatcher import PoolDispatcher
from workers.batching.job import Job, SummaryRequest

logger = logging.getLogger(__name__)

_DISPATCHER_ATTR = "_iq_dispatcher"


def dispatcher_for(consumer: Any) -> PoolDispatcher:
    """The consumer's dispatcher, made (and the pool capped at the GPUs) when it first
    starts; after a reconnect, the same one, reset for the new connection."""
    dispatcher = getattr(consumer, _DISPATCHER_ATTR, None)
    if dispatcher is None:
        dispatcher = PoolDispatcher(consumer)
        setattr(consumer, _DISPATCHER_ATTR, dispatcher)
        if isinstance(consumer.pool, TaskPool):  # the worker's (workers/broker/pool.py)
            consumer.pool.cap_children(pool_children(dispatcher.settings))
        on_child_ready(consumer.pool, dispatcher.child_ready)
        hold_ahead(consumer.pool, dispatcher.settings.batches_ahead)
    else:
        dispatcher.reset_for(consumer.connection)
    return dispatcher


def _decoded(message: Any, body: Any, uses_utc: bool) -> tuple[Any, Any, bool, bool]:
    """A task message's body, headers, whether decoded, whether UTC: as `Request` takes them
    (protocol 2's as they are; protocol 1's converted as Celery's default strategy does)."""
    if body is None:
        body = payload(message)
        if "args" not in body:  # protocol 2
            return body, message.headers, True, uses_utc
    return proto1_to_proto2(message, body)


def _job(message: Any, body: Any, uses_utc: bool, settlement: Any, task: Any, eventer: Any,
         **fixed: Any) -> Job:
    """The message's job (workers/batching/job.py), its Celery Request built now only where
    the message asks for more than a batch reads (`Job.light`). One it cannot be made from,
    or not a batching task's (a message pushed onto the queue by hand: no id, a body not a
    task's, its kwargs or its headers' headers not a mapping), is refused as an invalid task,
    as Celery's handler refuses one (logged, discarded), not raised into the consumer's loop:
    that would stop the worker (or reconnect it for ever), and the message, recovered, the
    next one, its queue stalled."""
    try:
        given = body
        body, headers, decoded, utc = _decoded(message, body, uses_utc)

        def make(job: Job) -> SummaryRequest:
            on_ack, on_reject = settlement.callbacks(message)
            return SummaryRequest(message, on_ack=on_ack, on_reject=on_reject, body=body,
                                  headers=headers, decoded=decoded, utc=utc, task=task,
                                  eventer=job.eventer, **fixed)

        if not isinstance(headers, dict):
            raise InvalidTaskError(f"headers {headers!r:.100} not a mapping")
        job = Job(message, headers, body, task, eventer, make, settlement.settle)
        if not (given is None and headers is message.headers and Job.light(headers)):
            request = job.request  # Celery reads it now, and refuses it as it would
            job.name, job.expires = request.name, request.expires
        nested = headers.get("headers")  # read again for its trace (BatchJob.of)
        if not isinstance(job.kwargs or {}, dict) or not isinstance(nested or {}, dict):
            raise InvalidTaskError(f"kwargs {job.kwargs!r:.100} or headers "
                                   f"{nested!r:.100} not a mapping")
        return job
    except REFUSED:
        raise
    except Exception as exc:
        raise InvalidTaskError(f"unreadable task message: {exc!r}") from exc


def batching_strategy(task: Any, app: Any, consumer: Any, **_kw: Any):
    """`Task.Strategy` for batching tasks: called once per task when the consumer starts."""
    model = model_of_task(task.name)
    spec = app.conf.iq_models[model]
    dispatcher = dispatcher_for(consumer)
    dispatcher.scheduler.add_model(model, dispatcher.batch_size(spec),
                                   spec.max_wait_ms / 1000.0)

    hostname = consumer.hostname
    eventer = consumer.event_dispatcher
    send_events = bool(eventer and eventer.enabled and task.send_events)
    connection_errors = consumer.connection_errors
    revoked_tasks = consumer.controller.state.revoked
    settlement = dispatcher.settlement
    uses_utc = app.uses_utc_timezone()
    fixed = {"app": app, "hostname": hostname, "connection_errors": connection_errors}

    def take(message: Any, body: Any, callbacks: Any) -> None:
        """One message into the buffer, a job; batches form once all are in."""
        request = _job(message, body, uses_utc, settlement, task, eventer, **fixed)
        if dispatcher.duplicate(request):
            return
        dispatcher.leases.hold(message)
        if (request.expires or request.id in revoked_tasks) and settlement.revoked(request):
            return
        if send_events:  # sent with the rest of the fetch's, before their batches form
            get = request.headers.get  # what Celery's Request would read of them
            dispatcher.received(request.id, {
                "name": request.name, "args": get("argsrepr", ""),
                "kwargs": get("kwargsrepr", ""), "root_id": get("root_id"),
                "parent_id": get("parent_id"), "retries": 0})
        for callback in callbacks or ():
            callback(request)
        if logger.isEnabledFor(logging.DEBUG):  # one INFO line a batch, in the child
            with trace(trace_headers(request).get("trace_id")):
                logger.debug("job %s received: model=%s", request.id, model)
        dispatcher.submit(model, request, pump=False)

    def task_message_handler(message, body, _ack, _reject, callbacks, **_kw):
        """Celery's way: one message (its ack and reject promises unused: leases settle)."""
        take(message, body, callbacks)
        dispatcher.pump_soon()

    def intake(messages: list, callbacks: Any, refused: Refused) -> None:
        """The worker's consumer's way (workers/broker/intake.py): a fetch's messages of this
        task in one call; one it cannot take is answered by `refused`, as Celery would."""
        for message in messages:
            try:
                take(message, None, callbacks)
            except REFUSED as exc:
                refused(message, exc)
        dispatcher.pump_soon()

    task_message_handler.intake = intake  # type: ignore[attr-defined]
    return task_message_handler


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
        liveness = dispatcher.liveness
        unknown = liveness.unknown_queues()
        if unknown:
            # Before the event loop runs, so nothing has been fetched (and dropped) yet.
            raise ConfigError(
                f"this worker consumes {', '.join(unknown)}, which no model in its models "
                f"file ({dispatcher.settings.models_file}) uses: their jobs would be dropped. "
                "Consume only its models' queues (IQ_WORKER_QUEUES, -Q), or give it the "
                "models file that declares them")
        dispatcher.fit_intake()  # no fetch before a child can serve
        liveness.start_consuming()
        # What it serves, reported now rather than at its first tick: a reload in between
        # found no worker, so its checks and the API's wait for the workers passed with none
        # to ask (a CI run: an API process took a file whose model no child could load).
        dispatcher.reloader.report()
        self._tick = c.timer.call_repeatedly(dispatcher.settings.heartbeat_interval_s,
                                             dispatcher.tick)

    def stop(self, c: Any) -> None:
        """Consuming ends: on a reconnect (`stop`), at a warm shutdown (`close`, before the
        pool finishes its running batches) and at the end (`shutdown`). What waits in the
        buffer goes back to its queue now rather than after a visibility timeout."""
        dispatcher = getattr(c, _DISPATCHER_ATTR, None)
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        if dispatcher is not None:
            dispatcher.liveness.stop_consuming()
            dispatcher.release_buffered("stopped consuming")

    def close(self, c: Any) -> None:
        """The worker stops: the running batches have `stop_timeout_s` to finish
        (workers/batching/stopping.py); results Redis still refuses are given up; a reload's turn
        it holds is given back (workers/batching/turns.py)."""
        self.stop(c)
        dispatcher = getattr(c, _DISPATCHER_ATTR, None)
        if dispatcher is not None:
            dispatcher.reloader.turn.release()  # the next worker goes now, not at its TTL
            dispatcher.stop_deadline.arm()
            dispatcher.settlement.give_back_unstored()

    shutdown = close

    def info(self, c: Any) -> dict[str, Any]:
        """Into `celery inspect stats` (Celery's `WorkController.stats` asks each consumer
        step): the Celery Requests this worker built, one only for a job that asked for more
        than a batch reads (workers/batching/job.py)."""
        return {"iq": {"requests_built": SummaryRequest.built}}
