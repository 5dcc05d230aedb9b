"""kombu and Celery as a worker adjusts them (workers/broker/), on a real Redis: each
adjustment works, and what it relies on is still where it was."""
from __future__ import annotations

import base64

import kombu
import pytest
import redis

from tasks.messages import task_message
from tasks.names import list_for
from workers.broker import Broker, installed
from workers.broker.events import EVENT_FLUSH_S
from workers.broker.transport import REDIS_ALIAS, select


@pytest.fixture
def redis_url(redis_server):
    return redis_server.extra["url"]


@pytest.fixture
def broker():
    """A worker's Broker, installed for the test and taken out after it."""
    broker = Broker().install()
    yield broker
    broker.uninstall()


def test_a_channel_reuses_one_client_and_follows_a_new_pool(redis_url, broker):
    with kombu.Connection(redis_url, transport=REDIS_ALIAS) as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
            assert first.connection_pool is channel.pool
        # As after a reconnect: the channel's pools are replaced, and the client with them.
        channel._disconnect_pools()
        with channel.conn_or_acquire() as renewed:
            assert renewed is not first
            assert renewed.connection_pool is channel.pool
            assert renewed.ping()


# -- what workers/broker/ relies on, checked against the installed kombu and Celery ------

def make_app(redis_url: str):
    from config import load_settings
    from tasks.celery_app import make_celery

    return make_celery(load_settings({"redis_url": redis_url}))


def worker_app(redis_url: str):
    """The app as a worker's main process runs it: with the worker's transport."""
    app = make_app(redis_url)
    select(app)
    return app


def empty_queue(redis_url: str, name: str) -> tuple[kombu.Queue, redis.Redis]:
    """A queue with nothing on it, and a client of its Redis."""
    server = redis.Redis.from_url(redis_url)
    server.delete(name)
    return kombu.Queue(name), server


def publish(conn: kombu.Connection, queue: kombu.Queue, *payloads: dict) -> None:
    for payload in payloads:
        conn.Producer().publish(payload, routing_key=queue.name, declare=[queue],
                                serializer="json")


def test_kombu_still_has_what_the_fetch_replaces_and_reads(redis_url, broker):
    """The fetch (workers/broker/fetch.py) replaces kombu's BRPOP command and its reply's
    reading, and is called by kombu's poller as kombu's own was."""
    import inspect

    from kombu.transport import redis as kombu_redis

    from workers.broker.fetch import ReliableChannel, ReliableQoS, ReliableSentinelChannel

    poller = inspect.getsource(kombu_redis.MultiChannelPoller)
    assert "channel._brpop_start()" in poller and "chan.handlers[type]()" in poller
    assert "channel.qos.restore_visible(" in poller  # the recovery's periodic call
    assert "channel._in_poll" in poller and "_brpop_sent_at" in poller
    assert "self.handlers = {'BRPOP': self._brpop_read" in inspect.getsource(
        kombu_redis.Channel.__init__)
    assert "self._in_poll" in inspect.getsource(kombu_redis.Channel.close)
    # The tick the worker's transport puts in place of kombu's (transport.py `_poll_start`)
    # does what kombu's did: the poller's turn, then each of its sockets on the loop.
    registering = inspect.getsource(kombu_redis.Transport.register_with_event_loop)
    assert "cycle_poll_start()" in registering and "loop.on_tick.add(on_poll_start)" in \
        registering
    assert "add_reader(fd, on_readable, fd) for fd in cycle.fds" in registering
    for name in ("_brpop_start", "_brpop_read", "basic_consume", "_basic_cancel",
                 "_q_for_pri", "_flush_brpop_reauth"):
        assert name in vars(kombu_redis.Channel), name
    assert "qos.append(message, message.delivery_tag)" in inspect.getsource(
        kombu_redis.virtual.Channel.basic_consume)
    # The worker's transports open the worker's channels; kombu's stay as shipped.
    assert kombu_redis.Transport.Channel is kombu_redis.Channel
    assert kombu_redis.SentinelTransport.Channel is kombu_redis.SentinelChannel
    assert issubclass(ReliableSentinelChannel, kombu_redis.SentinelChannel)
    with make_app(redis_url).connection_for_write() as conn:
        assert type(conn.default_channel) is kombu_redis.Channel
    app = worker_app(redis_url)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, ReliableChannel) and isinstance(channel.qos, ReliableQoS)
        for priority in (0, 3, 5, 7, 9):
            assert list_for("q", priority) == channel._q_for_pri("q", priority)


def test_a_failover_to_the_next_sentinel_keeps_the_worker_transport():
    """kombu's `Connection.switch` (its failover to the broker URL's next sentinel) takes
    the transport from the next URL's scheme: the worker's failover strategy gives it the
    worker's."""
    import json

    from kombu.transport import redis as kombu_redis

    from config import load_settings
    from tasks.celery_app import make_celery
    from workers.broker.transport import SENTINEL_ALIAS, SentinelTransport

    app = make_celery(load_settings({"redis_url": "redis://127.0.0.1:1/0"}))
    app.conf.broker_url = "sentinel://127.0.0.1:1/0;sentinel://127.0.0.1:2/0"
    select(app)
    assert app.conf.broker_transport == SENTINEL_ALIAS
    conn = app.connection_for_read()
    # What `celery inspect conf` and `stats` (Flower's worker page) send, as JSON.
    json.dumps([app.conf.broker_transport, app.conf.broker_failover_strategy, conn.info()])
    assert conn.transport_cls == SENTINEL_ALIAS
    assert isinstance(conn.transport, SentinelTransport)
    conn.maybe_switch_next()
    assert conn.port == 2 and conn.transport_cls == SENTINEL_ALIAS
    assert isinstance(conn.transport, SentinelTransport)
    assert issubclass(SentinelTransport, kombu_redis.SentinelTransport)
    plain = make_celery(load_settings({"redis_url": "redis://127.0.0.1:1/0"}))
    plain.conf.broker_url = app.conf.broker_url
    conn = plain.connection_for_read()
    conn.maybe_switch_next()
    assert type(conn.transport) is kombu_redis.SentinelTransport  # kombu's, as shipped


def test_the_event_loop_connections_never_retry(redis_url, broker):
    app = worker_app(redis_url)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert channel._connparams(asynchronous=True)["retry"].get_retries() == 0
        assert "retry" not in channel._connparams(asynchronous=False)


def test_a_built_message_is_what_send_task_publishes(redis_url):
    import json

    app = make_app(redis_url)
    server = redis.Redis.from_url(redis_url)
    server.delete("probe", "probe\x06\x165")
    kwargs = {"inputs": ["a"], "options": {}}
    app.send_task("iq.infer.probe", kwargs=kwargs, task_id="t-1", queue="probe", priority=5,
                  headers={"trace_id": "x"})
    sent = json.loads(server.rpop("probe\x06\x165"))
    built = task_message(app, "iq.infer.probe", "t-1", kwargs, queue="probe",
                                   priority=5, headers={"trace_id": "x"})
    mine = json.loads(built.payload)
    assert built.list_key == "probe\x06\x165"
    assert mine["headers"]["origin"] == sent["headers"]["origin"]  # gen<pid>@<host>, both
    sent["properties"].pop("delivery_tag"), mine["properties"].pop("delivery_tag")
    sent["properties"].pop("reply_to"), mine["properties"].pop("reply_to")
    assert json.loads(base64.b64decode(sent.pop("body"))) == \
        json.loads(base64.b64decode(mine.pop("body")))
    assert mine == sent


def test_task_events_show_a_summary_not_the_inputs(redis_url):
    import json

    app = make_app(redis_url)
    built = task_message(app, "iq.infer.probe", "t-2", {"inputs": ["secret text"]},
                                   queue="probe", priority=5,
                                   summary={"model": "probe", "inputs": 1})
    headers = json.loads(built.payload)["headers"]
    assert "secret" not in headers["kwargsrepr"] and "'inputs': 1" in headers["kwargsrepr"]


def test_task_events_wait_a_few_milliseconds_to_leave_together(broker):
    import inspect

    from celery.events.dispatcher import EventDispatcher
    from celery.worker.consumer import events

    from workers.broker.events import Consumer

    # Celery's worker buffers task events and has the consumer schedule their flush.
    assert "on_send_buffered=c.on_send_event_buffered" in inspect.getsource(events.Events.start)
    assert "on_send_buffered" in inspect.signature(EventDispatcher).parameters

    class Hub:
        def __init__(self):
            self.later = []

        def call_later(self, delay, callback, *args):
            self.later.append((delay, callback, args))

    flushed = []
    consumer = Consumer.__new__(Consumer)
    consumer.hub = Hub()
    consumer._flush_events = lambda: flushed.append(1)
    for _ in range(5):
        consumer.on_send_event_buffered()
    [(delay, callback, args)] = consumer.hub.later
    assert delay == EVENT_FLUSH_S and not flushed
    callback(*args)
    assert flushed == [1]
    consumer.on_send_event_buffered()  # a new event after the flush is flushed again
    assert len(consumer.hub.later) == 2


def test_the_pool_adjustments_replace_what_celery_calls(monkeypatch):
    import inspect
    from types import SimpleNamespace

    from celery.concurrency import prefork
    from celery.worker import control
    from celery.worker.consumer.consumer import Consumer

    from workers.broker.pool import TaskPool

    # A reconnect flushes the pool through the pool object's own `flush`, set per pool.
    assert "self.pool.flush()" in inspect.getsource(Consumer.on_close)
    assert "self.flush = " in inspect.getsource(prefork.TaskPool.on_start)
    assert "self.grow = P.grow" in inspect.getsource(prefork.TaskPool.on_start)
    # `control pool_grow` (and autoscale) grow it through the pool object's `grow`.
    assert "state.consumer.pool.grow(n)" in inspect.getsource(control.pool_grow)

    grown = []

    def celery_on_start(self):  # what Celery's on_start hands out, without children
        self._pool = SimpleNamespace(_processes=1)
        self.grow, self.flush = grown.append, grown.clear

    monkeypatch.setattr(prefork.TaskPool, "on_start", celery_on_start)
    pool = TaskPool.__new__(TaskPool)
    pool.on_start()
    pool.cap_children(1)
    assert pool.grow(1) is None and grown == []  # past the GPU count: refused
    pool._pool._processes = 0
    pool.grow(1)
    pool.flush()
    assert grown == [1]  # the flush dropped nothing
    pool.cap_children(0)  # a CPU-only host: no cap
    pool._pool._processes = 5
    pool.grow(2)
    assert grown == [1, 2]


def _ignore_sigterm_until_killed(ready) -> None:
    """A pool child once its models are loaded (workers/batching/stopping.py), running a batch."""
    import threading

    from workers.batching.stopping import hold_stops_for_the_main_process

    hold_stops_for_the_main_process()
    ready.set()
    threading.Event().wait(60)


def test_the_pool_stops_a_child_that_ignores_sigterm():
    """billiard's and Celery's ways to stop a pool child (its `terminate`, as a cold shutdown
    and a shrink call it, and `Pool.terminate_job`, as a cancel and `revoke --terminate` call
    it) send SIGKILL from the worker's pool (workers/broker/pool.py): a child that ignores
    SIGTERM still stops, where SIGTERM alone leaves it running."""
    import inspect
    import os
    import signal
    from types import SimpleNamespace

    import billiard
    from billiard.pool import Pool
    from billiard.context import SpawnProcess
    from billiard.process import BaseProcess
    from celery.worker.request import Request

    from workers.broker.pool import BlockingPool, ForkChild, SpawnChild
    from workers.broker.pool import Pool as WorkerPool

    # What calls them: a shrink and a reload's retirement, the pool's own stop, a cancel.
    assert "self.terminate()" in inspect.getsource(BaseProcess.terminate_controlled)
    assert "p.terminate()" in inspect.getsource(Pool._terminate_pool)
    assert "pool.terminate_job(self.worker_pid, signal)" in inspect.getsource(Request.cancel)
    # The pool makes its children through `Process`, of its context's class (spawn here).
    assert "self.Process(target=worker)" in inspect.getsource(Pool.WorkerProcess)
    for kind in (WorkerPool, BlockingPool):  # with the event loop, and without
        spawned = kind.__new__(kind)
        spawned._ctx = billiard.get_context("spawn")
        assert type(spawned.Process(target=print)) is SpawnChild
    assert issubclass(SpawnChild, SpawnProcess)

    ctx = billiard.get_context("fork")
    children = []
    for _ in range(3):
        ready = ctx.Event()
        child = ForkChild(target=_ignore_sigterm_until_killed, args=(ready,), daemon=True)
        child.start()
        assert ready.wait(30)
        children.append(child)
    stubborn, terminated, cancelled = children
    try:
        os.kill(stubborn.pid, signal.SIGTERM)
        stubborn.join(1)
        assert stubborn.exitcode is None  # SIGTERM alone: still running its batch
        stubborn.terminate_controlled()
        pool = WorkerPool.__new__(WorkerPool)
        pool._process_by_pid = lambda pid: (cancelled, 0)
        pool.terminate_job(cancelled.pid, signal.SIGTERM)
        terminated.terminate()
        for child in children:
            child.join(10)
            assert child.exitcode == -signal.SIGKILL
        assert cancelled._controlled_termination and stubborn._controlled_termination
    finally:
        for child in children:
            if child.exitcode is None:
                os.kill(child.pid, signal.SIGKILL)


def test_the_pool_tells_the_dispatcher_when_a_child_is_ready():
    """A pool child says WORKER_UP once its initializer (worker_process_init: its models
    loaded) returned; the pool hands it to its `on_process_alive`, looked up when the pool is
    made. The worker's pool (workers/broker/pool.py) also calls the callback `on_child_ready`
    gave it, after the child counts among those that take work."""
    import inspect
    from types import SimpleNamespace

    from billiard.pool import Worker
    from celery.concurrency.asynpool import AsynPool

    from workers.broker.pool import Pool, on_child_ready, ready_children

    child = inspect.getsource(Worker.__call__)
    assert child.index("self.after_fork()") < child.index("self.on_loop_start(pid=pid)")
    assert "self.initializer(*self.initargs)" in inspect.getsource(Worker.after_fork)
    assert "on_process_alive=self.on_process_alive" in \
        inspect.getsource(AsynPool.create_result_handler)

    class Child:  # a pool process as the pool's books hold it
        pid, inqW_fd, synqW_fd = 41, 7, None

        def _is_alive(self) -> bool:
            return True

    proc = Child()
    inner = Pool.__new__(Pool)
    for name, value in dict(_pool=[proc], _fileno_to_inq={}, _fileno_to_synq={},
                            _all_inqueues=set(), _waiting_to_start={proc}).items():
        setattr(inner, name, value)
    told: list[tuple[int, set[int]]] = []
    pool = SimpleNamespace(_pool=inner)
    assert on_child_ready(pool, lambda pid: told.append((pid, ready_children(pool))))
    inner.on_process_alive(41)
    assert told == [(41, {41})]
    assert not on_child_ready(SimpleNamespace(_pool=None), print)  # not started: no callback
    celery_own = SimpleNamespace(_pool=AsynPool.__new__(AsynPool))
    assert not on_child_ready(celery_own, print)  # Celery's pool, as shipped: no callback


def test_a_stored_result_is_what_celery_stores_and_reads(redis_url):
    """Celery's own store_result and `stored` write the same thing (an embedding's outputs
    packed: 4 bytes a value, a failure as Celery's JSON), and AsyncResult reads either back
    as numbers (the app's result serializer)."""
    import numpy as np
    import orjson

    from tasks import results
    from tasks.errors import JobError
    from tasks.keys import result_key

    app = make_app(redis_url)
    server = redis.Redis.from_url(redis_url)
    failure = JobError("inference_error", "boom")
    vectors = [[0.5, 1.0, -0.25], [0.125]]
    app.backend.store_result("r-ok", {"outputs": vectors}, "SUCCESS")  # Celery's own route
    mine = results.stored("r-ok", outputs=vectors)
    assert server.get(result_key("r-ok")) == mine
    rows = [np.asarray(v, dtype=np.float32) for v in vectors]  # as a float32 model's handler
    app.backend.store_result("r-ok", {"outputs": rows}, "SUCCESS")
    assert server.get(result_key("r-ok")) == mine == results.stored("r-ok", outputs=rows)
    assert len(mine) == 2 + 2 + 2 * 4 + 4 * 4  # prefix, count, lengths, float32 values
    assert len(results.stored("one", outputs=[[0.5] * 384])) == 2 + 384 * 4
    app.backend.store_result("r-failed", failure, "FAILURE")
    stored = orjson.loads(server.get(result_key("r-failed")))
    written = orjson.loads(results.stored("r-failed", error=failure))
    assert stored.pop("date_done") and written.pop("date_done")
    assert written == stored
    for job_id in ("r-ok", "r-failed"):  # as the workers write them
        server.set(result_key(job_id), results.stored(job_id, outputs=vectors) if
                   job_id == "r-ok" else results.stored(job_id, error=failure))
    assert app.AsyncResult("r-ok").state == "SUCCESS"
    assert app.AsyncResult("r-ok").result == {"outputs": vectors}
    assert app.AsyncResult("r-ok").get(timeout=5) == {"outputs": vectors}  # names its task
    assert results.outputs_of(server.get(result_key("r-ok"))) == vectors
    read_back = app.AsyncResult("r-failed").result
    assert app.AsyncResult("r-failed").state == "FAILURE"
    assert isinstance(read_back, JobError) and read_back.code == "inference_error"
    assert results.outputs_of(server.get(result_key("r-failed"))) is None


def test_through_the_sentinels_celery_stores_and_reads_a_packed_result(tmp_path):
    """With Sentinel, the result backend is Celery's Sentinel one extended as the Redis one is
    (tasks/results.py): it asks the sentinels for the primary, stores an embedding's outputs
    packed, and AsyncResult reads a packed result back, naming its task."""
    from config import load_settings
    from scripts.redis_nodes import start_group
    from tasks import results
    from tasks.celery_app import make_celery
    from tasks.keys import result_key

    group = start_group(tmp_path, replicas=0, sentinels=1)
    try:
        app = make_celery(load_settings({"redis_url": group.primary.extra["url"]},
                                        environ=group.env()))
        assert isinstance(app.backend, results.SentinelResultBackend)
        server = redis.Redis.from_url(group.primary.extra["url"])
        vectors = [[0.5, 1.0, -0.25], [0.125]]
        app.backend.store_result("s-celery", {"outputs": vectors}, "SUCCESS")
        assert server.get(result_key("s-celery")) == results.stored("s-celery", outputs=vectors)
        server.set(result_key("s-ok"), results.stored("s-ok", outputs=vectors))
        assert app.AsyncResult("s-ok").get(timeout=5) == {"outputs": vectors}
    finally:
        group.stop()


def test_only_a_starting_worker_adjusts_kombu_and_celery():
    """The API, Flower's and the CLI's app (tasks.cli) run kombu and Celery as shipped; so
    does a process that merely imports a worker entry module (only a worker reads
    `worker_consumer` and `worker_pool`). A worker installs its Broker and selects its
    transport when it starts, in its main process, and runs its pool in place of prefork's;
    no class of kombu, Celery or billiard is changed."""
    import subprocess
    import sys

    from scripts.stack import ROOT

    code = """
import os
from celery import signals
from celery.concurrency import prefork
from celery.concurrency import thread as threads
from billiard.pool import Pool
from billiard.process import BaseProcess
from celery.concurrency.asynpool import AsynPool
from celery.worker.consumer.consumer import Consumer
from kombu.transport import redis as kombu_redis
from app import create_app
import tasks.cli
from workers.broker import installed
from workers.broker.pool import TaskPool
shipped = {c: dict(vars(c)) for c in (kombu_redis.Channel, kombu_redis.QoS,
           kombu_redis.Transport, kombu_redis.SentinelTransport, Consumer, Pool, AsynPool,
           BaseProcess, prefork.TaskPool)}
create_app()
assert installed() is None, "the API or tasks.cli adjusted kombu"
assert tasks.cli.celery.conf.broker_transport is None
os.environ['IQ_WEBHOOK_SECRET'] = 's3cret'
import workers.main, deliverer.main
assert installed() is None, "importing a worker entry module adjusted kombu"
assert workers.main.celery.conf.broker_transport is None
class Worker:  # what Celery sends worker_init with: its WorkController
    app = workers.main.celery
    hostname = 'w@h'
    pool_cls = prefork.TaskPool  # as -P prefork gives it
worker = Worker()
signals.worker_init.send(sender=worker)
assert installed() is workers.main.celery.conf.iq_broker
assert workers.main.celery.conf.broker_transport == 'iqredis'
assert worker.pool_cls is TaskPool
class Deliverer:
    app = deliverer.main.celery
    pool_cls = threads.TaskPool
signals.worker_init.send(sender=Deliverer())
assert Deliverer.pool_cls is threads.TaskPool  # its threads, as asked
for c, attrs in shipped.items():
    assert dict(vars(c)) == attrs, c
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_moved_method_fails_the_start_loudly(monkeypatch):
    from kombu.transport import redis as kombu_redis

    from workers.broker import seam

    class Moved(kombu_redis.QoS):  # `append` is inherited here, not defined
        def ack(self, tag, multiple=False):  # another signature
            pass

    moved = (seam.Name(Moved, "append", ("self", "message", "delivery_tag")),
             seam.Name(Moved, "ack", ("self", "delivery_tag")))
    monkeypatch.setattr(seam, "OVERRIDDEN", moved)
    with pytest.raises(RuntimeError, match="no longer defines append") as err:
        Broker().install()
    assert "Moved.ack now takes ('self', 'tag', 'multiple')" in str(err.value)
    assert installed() is None
    monkeypatch.undo()
    first = Broker().install()
    try:
        with pytest.raises(RuntimeError, match="another Broker"):
            Broker().install()
        assert first.install() is first
    finally:
        first.uninstall()
    assert installed() is None


def test_a_pickled_broker_arrives_empty_and_uninstalled(broker):
    """The app's configuration holds the Broker and is pickled for every spawned pool
    child: the child's copy is a fresh one."""
    import pickle

    broker.held["t"] = object()
    broker.to_ack["u"] = object()
    copy = pickle.loads(pickle.dumps(broker))
    assert isinstance(copy, Broker) and copy is not broker
    assert not copy.held and not copy.to_ack and installed() is broker
    assert copy.incarnation != broker.incarnation and copy.lease_s == broker.lease_s
