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


@pytest.fixture
def redis_url(redis_server):
    return redis_server.extra["url"]


@pytest.fixture
def broker():
    """A worker's adjustments, installed for the test and taken out after it."""
    broker = Broker().install()
    yield broker
    broker.uninstall()


def test_a_channel_reuses_one_client_and_follows_a_new_pool(redis_url, broker):
    with kombu.Connection(redis_url) as conn:
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
    for name in ("_brpop_start", "_brpop_read", "basic_consume", "_basic_cancel",
                 "_q_for_pri", "_flush_brpop_reauth"):
        assert name in vars(kombu_redis.Channel), name
    assert "qos.append(message, message.delivery_tag)" in inspect.getsource(
        kombu_redis.virtual.Channel.basic_consume)
    # Installed, kombu's transports open the worker's channels.
    assert kombu_redis.Transport.Channel is ReliableChannel
    assert kombu_redis.SentinelTransport.Channel is ReliableSentinelChannel
    assert issubclass(ReliableSentinelChannel, kombu_redis.SentinelChannel)
    app = make_app(redis_url)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert isinstance(channel, ReliableChannel) and isinstance(channel.qos, ReliableQoS)
        for priority in (0, 3, 5, 7, 9):
            assert list_for("q", priority) == channel._q_for_pri("q", priority)


def test_the_event_loop_connections_never_retry(redis_url, broker):
    app = make_app(redis_url)
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
    for volatile in ("origin",):
        sent["headers"].pop(volatile), mine["headers"].pop(volatile)
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
    from celery.worker.consumer.consumer import Consumer

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


def test_the_pool_adjustments_replace_what_celery_calls():
    import inspect
    from types import SimpleNamespace

    from celery.concurrency import prefork
    from celery.worker import control
    from celery.worker.consumer.consumer import Consumer

    from workers.broker.pool import guard_pool_growth, keep_batches_through_reconnects

    # A reconnect flushes the pool through the pool object's own `flush`, set per pool.
    assert "self.pool.flush()" in inspect.getsource(Consumer.on_close)
    assert "self.flush = " in inspect.getsource(prefork.TaskPool.on_start)
    # `control pool_grow` (and autoscale) grow it through the pool object's `grow`.
    assert "state.consumer.pool.grow(n)" in inspect.getsource(control.pool_grow)

    grown = []
    pool = SimpleNamespace(num_processes=1, grow=grown.append, flush=lambda: grown.clear())
    guard_pool_growth(pool, gpus=1)
    keep_batches_through_reconnects(pool)
    assert pool.grow(1) is None and grown == []  # past the GPU count: refused
    pool.num_processes = 0
    pool.grow(1)
    pool.flush()
    assert grown == [1]  # the flush dropped nothing


def _ignore_sigterm_until_killed(ready) -> None:
    """A pool child once its models are loaded (workers/stopping.py), running a batch."""
    import threading

    from workers.stopping import hold_stops_for_the_main_process

    hold_stops_for_the_main_process()
    ready.set()
    threading.Event().wait(60)


def test_the_pool_stops_a_child_that_ignores_sigterm(broker):
    """billiard's and Celery's ways to stop a pool child (its `terminate`, as a cold shutdown
    and a shrink call it, and `Pool.terminate_job`, as a cancel and `revoke --terminate` call
    it) send SIGKILL while the Broker is installed: a child that ignores SIGTERM still stops,
    where SIGTERM alone leaves it running."""
    import inspect
    import os
    import signal
    from types import SimpleNamespace

    import billiard
    from billiard.pool import Pool
    from billiard.process import BaseProcess
    from celery.worker.request import Request

    # What calls them: a shrink and a reload's retirement, the pool's own stop, a cancel.
    assert "self.terminate()" in inspect.getsource(BaseProcess.terminate_controlled)
    assert "p.terminate()" in inspect.getsource(Pool._terminate_pool)
    assert "pool.terminate_job(self.worker_pid, signal)" in inspect.getsource(Request.cancel)

    ctx = billiard.get_context("fork")
    children = []
    for _ in range(3):
        ready = ctx.Event()
        child = ctx.Process(target=_ignore_sigterm_until_killed, args=(ready,), daemon=True)
        child.start()
        assert ready.wait(30)
        children.append(child)
    stubborn, terminated, cancelled = children
    try:
        os.kill(stubborn.pid, signal.SIGTERM)
        stubborn.join(1)
        assert stubborn.exitcode is None  # SIGTERM alone: still running its batch
        stubborn.terminate_controlled()
        pool = SimpleNamespace(_process_by_pid=lambda pid: (cancelled, 0))
        Pool.terminate_job(pool, cancelled.pid, signal.SIGTERM)
        terminated.terminate()
        for child in children:
            child.join(10)
            assert child.exitcode == -signal.SIGKILL
        assert cancelled._controlled_termination and stubborn._controlled_termination
    finally:
        for child in children:
            if child.exitcode is None:
                os.kill(child.pid, signal.SIGKILL)


def test_the_pool_tells_the_dispatcher_when_a_child_is_ready(broker):
    """A pool child says WORKER_UP once its initializer (worker_process_init: its models
    loaded) returned; the pool hands it to its `on_process_alive`, looked up when the pool is
    made, after the Broker is installed. With the Broker, that also calls the callback
    `on_child_ready` gave the pool, after the child counts among those that take work."""
    import inspect
    from types import SimpleNamespace

    from billiard.pool import Worker
    from celery.concurrency.asynpool import AsynPool

    from workers.broker.pool import on_child_ready, ready_children

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
    inner = SimpleNamespace(_pool=[proc], _fileno_to_inq={}, _fileno_to_synq={},
                            _all_inqueues=set(), _waiting_to_start={proc})
    told: list[tuple[int, set[int]]] = []
    pool = SimpleNamespace(_pool=inner)
    assert on_child_ready(pool, lambda pid: told.append((pid, ready_children(pool))))
    AsynPool.on_process_alive(inner, 41)
    assert told == [(41, {41})]
    assert not on_child_ready(SimpleNamespace(_pool=None), print)  # not started: no callback


def test_a_stored_result_is_what_celery_stores_and_reads(redis_url):
    """Celery's own store_result and `stored` write the same thing (an embedding's outputs
    packed: 4 bytes a value, a failure as Celery's JSON), and AsyncResult reads either back
    as numbers (the app's result serializer)."""
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
    does a process that merely imports a worker entry module. A worker installs its Broker
    when it starts, in its main process."""
    import subprocess
    import sys

    from scripts.stack import ROOT

    code = """
import os
from celery import signals
from app import create_app
import tasks.cli
from workers.broker import installed
create_app()
assert installed() is None, "the API or tasks.cli adjusted kombu"
os.environ['IQ_WEBHOOK_SECRET'] = 's3cret'
import workers.main, workers.webhook_main
assert installed() is None, "importing a worker entry module adjusted kombu"
class Worker:  # what Celery sends worker_init with: its WorkController
    app = workers.main.celery
signals.worker_init.send(sender=Worker())
assert installed() is workers.main.celery.conf.iq_broker
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_moved_method_fails_the_install_loudly():
    from kombu.transport import redis as kombu_redis

    from workers.broker.patch import Patch

    class Moved(kombu_redis.QoS):  # `append` is inherited here, not defined
        pass

    with pytest.raises(RuntimeError, match="no longer defines append"):
        Patch(Moved, "append", lambda original: original).apply()
    assert installed() is None
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
