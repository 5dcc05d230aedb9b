"""The names of kombu, Celery, billiard, redis-py and gunicorn that the service overrides or
reads without those libraries promising to keep them (private, or undocumented), in one list:
`OVERRIDDEN` (methods the worker's classes in workers/broker/ override: each must still be
defined where it was, taking the same parameters), `READ` (what workers/broker/ reads or
calls), `ELSEWHERE` (what the worker's strategy and settlement, and tasks/, read or
override) and the API's (gunicorn's and Flask's, for web/ and app/: `every`).
docs/upgrading.md's table names each of them, and nothing else; tests/unit/test_seam.py
fails on a version that moved or changed one, and a worker checks `OVERRIDDEN` when it
starts (`check`), so that an upgrade that moves a method fails loudly rather than leave the
override unused."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType

from billiard.pool import Pool as BilliardPool
from billiard import semaphore_tracker
from billiard import util as billiard_util
from billiard.process import BaseProcess
from billiard.semaphore_tracker import SemaphoreTracker
from celery.concurrency import prefork
from celery.backends.base import BaseKeyValueStoreBackend
from celery.backends.redis import SentinelBackend
from celery.concurrency.asynpool import AsynPool
from celery.events.dispatcher import EventDispatcher
from celery.worker import state as worker_state
from celery.worker import strategy as celery_strategy
from celery.worker.consumer.consumer import Consumer
from celery.worker.request import Request
from kombu.asynchronous.hub import Hub
from kombu.clocks import LamportClock
from kombu.messaging import Consumer as KombuConsumer
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from redis.connection import AbstractConnection
from redis.retry import Retry


@dataclass(frozen=True)
class Name:
    """`owner.name`: a function defined on `owner` (a class or a module) itself with
    parameters `params` (their names, self first), or, with `params` None, an attribute
    `owner`'s own code sets or defines."""

    owner: type | ModuleType
    name: str
    params: tuple[str, ...] | None = None

    @property
    def short(self) -> str:
        """As docs/upgrading.md's table writes it: `Class.name`, or `module.name`."""
        if isinstance(self.owner, ModuleType):
            return f"{self.owner.__name__}.{self.name}"
        return f"{self.owner.__qualname__}.{self.name}"

    def __str__(self) -> str:
        if isinstance(self.owner, ModuleType):
            return self.short
        return f"{self.owner.__module__}.{self.short}"

    def problem(self) -> str | None:
        """What moved, in one line; None when it is where the worker expects it."""
        if self.params is None:
            if self.name in vars(self.owner) or \
                    f"self.{self.name}" in inspect.getsource(self.owner):
                return None
            return f"{self} is no longer set where it was"
        if self.name not in vars(self.owner):
            return f"{str(self).rpartition('.')[0]} no longer defines {self.name}"
        found = tuple(inspect.signature(vars(self.owner)[self.name]).parameters)
        if found != self.params:
            return f"{self} now takes {found}, the worker's override {self.params}"
        return None


_Channel, _QoS = kombu_redis.Channel, kombu_redis.QoS

# Overridden by the worker's subclasses (fetch.py, clients.py, transport.py, events.py,
# intake.py, pool.py, tracker.py).
OVERRIDDEN: tuple[Name, ...] = (
    Name(_Channel, "_create_client", ("self", "asynchronous")),
    Name(_Channel, "_connparams", ("self", "asynchronous")),
    Name(_Channel, "_brpop_start", ("self", "timeout")),
    Name(_Channel, "_brpop_read", ("self", "options")),
    Name(_Channel, "_basic_cancel", ("self", "consumer_tag")),
    Name(_Channel, "basic_consume", ("self", "queue", "args", "kwargs")),
    Name(_QoS, "append", ("self", "message", "delivery_tag")),
    Name(_QoS, "ack", ("self", "delivery_tag")),
    Name(_QoS, "reject", ("self", "delivery_tag", "requeue")),
    Name(_QoS, "restore_unacked", ("self", "client")),
    Name(_QoS, "restore_visible", ("self", "start", "num", "interval")),
    Name(virtual.QoS, "can_consume", ("self",)),
    Name(kombu_redis.Transport, "register_with_event_loop", ("self", "connection", "loop")),
    Name(Consumer, "on_send_event_buffered", ("self",)),
    Name(Consumer, "create_task_handler", ("self", "promise")),
    Name(prefork.TaskPool, "on_start", ("self",)),
    Name(BilliardPool, "Process", ("self", "args", "kwds")),
    Name(BilliardPool, "terminate_job", ("self", "pid", "sig")),
    Name(BilliardPool, "_repopulate_pool", ("self", "exitcodes")),
    Name(AsynPool, "on_process_alive", ("self", "pid")),
    Name(AsynPool, "_create_write_handlers", ("self", "hub", "pack", "dumps", "protocol")),
    Name(AsynPool, "_track_child_process", ("self", "proc", "hub")),
    Name(BaseProcess, "terminate", ("self",)),
    Name(SemaphoreTracker, "_send", ("self", "cmd", "name")),
)

# Read or called (fetch.py, leases.py, transport.py, events.py, intake.py, pool.py,
# tracker.py).
READ: tuple[Name, ...] = (
    Name(_Channel, "_q_for_pri", ("self", "queue", "pri")),
    Name(_Channel, "_flush_brpop_reauth", ("self",)),
    Name(_Channel, "_in_poll"),
    Name(_Channel, "_brpop_sent_at"),
    Name(_Channel, "_queue_cycle"),
    Name(_Channel, "_closing"),
    Name(virtual.Channel, "_tag_to_queue"),
    Name(kombu_redis.MultiChannelPoller, "_channels"),
    Name(kombu_redis.MultiChannelPoller, "_chan_to_sock"),
    Name(virtual.QoS, "_delivered"),
    Name(virtual.QoS, "_flush", ("self",)),
    Name(virtual.Transport, "_deliver", ("self", "message", "queue")),
    Name(Consumer, "_flush_events", ("self",)),
    Name(Consumer, "strategies"),
    Name(Consumer, "on_task_message"),
    Name(Consumer, "on_invalid_task", ("self", "body", "message", "exc")),
    Name(Consumer, "on_decode_error", ("self", "message", "exc")),
    Name(KombuConsumer, "_receive_callback", ("self", "message")),
    Name(EventDispatcher, "_group_buffer"),
    Name(LamportClock, "mutex"),
    Name(prefork.TaskPool, "_pool"),
    Name(BilliardPool, "_ctx"),
    Name(BilliardPool, "_pool"),
    Name(BilliardPool, "_processes"),
    Name(BilliardPool, "_putlock"),
    Name(AsynPool, "_all_inqueues"),
    Name(AsynPool, "_busy_workers"),
    Name(AsynPool, "_mark_worker_as_available"),
    Name(AsynPool, "_active_writes"),
    Name(AsynPool, "outbound_buffer"),
    Name(AsynPool, "_quick_put"),
    Name(AsynPool, "sched_strategy"),
    Name(Hub, "consolidate_callback"),
    Name(BaseProcess, "_check_closed", ("self",)),
    Name(BaseProcess, "_popen"),
    Name(BaseProcess, "_is_alive", ("self",)),
    Name(BaseProcess, "terminate_controlled", ("self",)),
    Name(SemaphoreTracker, "_fd"),
    Name(SemaphoreTracker, "_lock"),
    Name(semaphore_tracker, "_semaphore_tracker"),
    Name(billiard_util, "_args_from_interpreter_flags", ()),
)


# Read or overridden outside workers/broker/: the worker's prefetch
# (workers/batching/prefetch.py), the batching strategy's jobs and their Celery requests
# (workers/batching/job.py, workers/batching/strategy.py, workers/batching/settlement.py,
# workers/batching/dispatcher.py, state.py), the result backends (tasks/results.py) and the
# Redis clients' retries and connections' sockets (tasks/redis_client.py).
ELSEWHERE: tuple[Name, ...] = (
    Name(celery_strategy, "proto1_to_proto2", ("message", "body")),
    Name(Consumer, "prefetch_multiplier"),
    Name(Consumer, "initial_prefetch_count"),
    Name(Consumer, "qos"),
    Name(Request, "__init__", ("self", "message", "on_ack", "hostname", "eventer", "app",
                               "connection_errors", "request_dict", "task", "on_reject",
                               "body", "headers", "decoded", "utc", "maybe_make_aware",
                               "maybe_iso8601", "opts")),
    Name(Request, "acknowledged"),
    Name(Request, "worker_pid"),
    Name(Request, "time_start"),
    Name(Request, "eventer"),
    Name(worker_state, "task_ready", ("request", "successful", "remove_request",
                                      "discard_active_request", "discard_reserved_request",
                                      "discard_scheduled_request")),
    Name(worker_state, "task_reserved", ("request", "add_request", "add_reserved_request",
                                         "discard_scheduled_request")),
    Name(worker_state, "requests"),
    Name(worker_state, "reserved_requests"),
    Name(worker_state, "active_requests"),
    Name(worker_state, "revoked"),
    Name(BaseKeyValueStoreBackend, "_get_task_meta_for", ("self", "task_id")),
    Name(SentinelBackend, "_get_sentinel_instance", ("self", "params")),
    Name(Retry, "_backoff"),
    Name(Retry, "_supported_errors"),
    Name(AbstractConnection, "_sock"),
)


def _api_names() -> tuple[Name, ...]:
    """gunicorn's, which the API's worker, HTTP/1 parser and answer (web/worker.py's Worker,
    web/request.py's Request and Parser, web/answer.py's Reply) override or read, and Flask's,
    which the API's Flask class (app/application.py Api) reads; none where they are not
    installed (a worker's image: requirements/worker.txt)."""
    try:
        from flask import Flask
        from flask.ctx import RequestContext
        from gunicorn import util as gunicorn_util
        from gunicorn.http import body, message, wsgi
        from gunicorn.http.parser import Parser
        from gunicorn.http.parser import RequestParser
        from gunicorn.http2 import negotiation
        from gunicorn.workers.base_async import AsyncWorker
    except ImportError:
        return ()
    return (
        Name(AsyncWorker, "handle", ("self", "listener", "client", "addr")),
        Name(AsyncWorker, "handle_request", ("self", "listener_name", "req", "sock", "addr")),
        Name(wsgi, "create", ("req", "sock", "client", "server", "cfg", "response_class",
                              "response_args")),
        Name(wsgi.Response, "process_headers", ("self", "headers")),
        Name(wsgi.Response, "default_headers", ("self",)),
        Name(gunicorn_util, "hop_headers"),
        Name(AsyncWorker, "_try_h2c_upgrade", ("self", "listener", "req", "parser", "client",
                                               "addr")),
        Name(negotiation, "prior_knowledge_allowed", ("cfg", "peer_addr")),
        Name(RequestParser, "mesg_class"),
        Name(Parser, "finish_body", ("self", "deadline", "max_bytes")),
        Name(body.Body, "reader"),
        Name(body.Body, "buf"),
        Name(body.Body, "failed"),
        Name(body.LengthReader, "length"),
        Name(message.Message, "parse_headers", ("self", "data", "from_trailer")),
        Name(message.Message, "limit_request_fields"),
        Name(message.Message, "limit_request_field_size"),
        Name(message.HeaderPolicy, "_peer_is_trusted_proxy", ("self",)),
        Name(message.HeaderPolicy, "_peer_trusted_for_forwarded", ("self",)),
        Name(RequestContext, "_after_request_functions"),
        Name(RequestContext, "_session"),
        Name(Flask, "_got_first_request"),
    )


def every() -> tuple[Name, ...]:
    """Every name of the list. The API's are imported only here, when asked (the tests, the
    docs' table): a worker, which checks OVERRIDDEN alone, never imports Flask or gunicorn."""
    return OVERRIDDEN + READ + ELSEWHERE + _api_names()


def problems(names: tuple[Name, ...]) -> list[str]:
    return [p for p in (n.problem() for n in names) if p is not None]


def check() -> None:
    """At a worker's start: every method the worker's classes override is still where it
    was, taking what it took; else the start fails, naming each that moved."""
    found = problems(OVERRIDDEN)
    if found:
        raise RuntimeError("; ".join(found) + ": the installed kombu, Celery or billiard is "
                           "not the one workers/broker/ was written for (docs/upgrading.md)")
