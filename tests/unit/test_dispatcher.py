"""The dispatcher's order of things (workers/batching/dispatcher.py,
workers/batching/settlement.py), with a fake pool and timer: a freed child gets its next batch
before the last batch is acknowledged, and a batch's acks go to Redis together."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from config import load_settings
from config.models import parse_model
from workers.broker import Broker
from workers.batching.dispatcher import PoolDispatcher
from workers.batching.reload import Failing, QueuesConsumed, ReloadHost
from workers.batching.stopping import PoolChildren, Stoppable
from workers.batching.watchdog import Watched
from workers.child.batch import JobOutcome, Outcome


class FakePool:
    num_processes = 1

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def apply_async(self, fn, args, **kw) -> None:
        self.calls.append({"args": args, **kw})


class FakeTimer:
    def __init__(self) -> None:
        self.due: list[tuple[float, Any, tuple]] = []

    def call_after(self, delay, fn, args=()):
        self.due.append((delay, fn, args))
        return SimpleNamespace(cancel=lambda: None)

    def run_due(self) -> None:
        due, self.due = self.due, []
        for _delay, fn, args in due:
            fn(*args)


class FakeInFlight:
    def __init__(self, state) -> None:
        self.state = state
        self.acked: list[list[str]] = []

    def ack(self, tags) -> None:
        if tags:
            self.acked.append(list(tags))

    def restore(self, tags) -> int:
        return 0


@dataclass(eq=False)
class FakeRequest:
    id: str
    kwargs: dict = field(default_factory=lambda: {"inputs": ["x"]})
    request_dict: dict = field(default_factory=dict)
    delivery_info: dict = field(default_factory=dict)
    acknowledged: bool = False

    def __post_init__(self) -> None:
        self.message = SimpleNamespace(delivery_tag=f"tag-{self.id}", channel=None)

    def revoked(self) -> bool:
        return False

    def on_accepted(self, pid, time_accepted) -> None:
        pass

    def on_success(self, failed_retval_runtime) -> None:
        self.acknowledge()

    def acknowledge(self) -> None:
        self._on_ack(None, None)
        self.acknowledged = True


def dispatcher() -> tuple[PoolDispatcher, FakePool, FakeTimer, FakeInFlight]:
    pool, timer = FakePool(), FakeTimer()
    spec = parse_model("m", {"kind": "synthetic", "max_batch_size": 4}, base=None)
    app = SimpleNamespace(conf=SimpleNamespace(
        iq_settings=load_settings({"redis_url": "redis://127.0.0.1:1/0"}, environ={}),
        iq_models={"m": spec}, iq_models_revision="", iq_broker=Broker()))
    consumer = SimpleNamespace(app=app, pool=pool, timer=timer, connection=object(),
                               hostname="w@test")
    d = PoolDispatcher(consumer)
    unacked = d.leases.inflight = FakeInFlight(app.conf.iq_broker)
    d.scheduler.add_model("m", 4, 0.005)
    return d, pool, timer, unacked


def receive(d: PoolDispatcher, job_id: str) -> FakeRequest:
    request = FakeRequest(job_id)
    request._on_ack, _reject = d.settlement.callbacks(request.message)
    d.leases.hold(request.message)
    d.submit("m", request)
    return request


def test_a_freed_child_gets_its_next_batch_before_the_last_one_is_acknowledged():
    d, pool, timer, unacked = dispatcher()
    first = receive(d, "a")
    assert [job.id for job in pool.calls[0]["args"][1]] == ["a"]  # idle worker: at once
    second, third = receive(d, "b"), receive(d, "c")
    assert len(pool.calls) == 1  # the only child is busy: they wait in the buffer

    pool.calls[0]["callback"]([JobOutcome("a", Outcome.SUCCEEDED, 0.1, 1)])
    # The next batch went to the child at once; the last one's acks wait for the timer.
    assert [job.id for job in pool.calls[1]["args"][1]] == ["b", "c"]
    assert unacked.acked == [] and not first.acknowledged
    assert [delay for delay, _fn, _args in timer.due] == [0.001]

    timer.run_due()
    assert unacked.acked == [["tag-a"]] and first.acknowledged

    pool.calls[1]["callback"]([JobOutcome("b", Outcome.SUCCEEDED, 0.1, 1),
                               JobOutcome("c", Outcome.SUCCEEDED, 0.1, 1)])
    timer.run_due()
    assert unacked.acked[-1] == ["tag-b", "tag-c"]  # one round trip for the batch
    assert second.acknowledged and third.acknowledged


def test_the_reload_the_stop_deadline_and_the_watchdog_get_what_their_interfaces_name():
    """The main process's back-references are typed interfaces handed in (reload.py
    ReloadHost, stopping.py Stoppable, watchdog.py Watched), not `Any`: the dispatcher and its
    liveness have every member those name, so a rename fails here rather than in a reload or a
    stop."""
    d, *_ = dispatcher()
    assert isinstance(d, ReloadHost) and isinstance(d, Stoppable)
    assert isinstance(d.liveness, QueuesConsumed) and isinstance(d.liveness, PoolChildren)
    assert isinstance(d.liveness, Watched) and isinstance(d.settlement, Failing)
    assert d.reloader.dispatcher is d and d.stop_deadline.dispatcher is d
    assert d.liveness.watchdog.liveness is d.liveness


class Child:
    """A pool process as Celery's prefork pool books it: `ready` once it said WORKER_UP."""

    def __init__(self, pid: int) -> None:
        self.pid, self.inqW_fd = pid, 100 + pid

    def _is_alive(self) -> bool:
        return True


def test_with_no_child_to_serve_the_buffer_goes_back_and_nothing_is_fetched():
    from billiard.einfo import ExceptionInfo
    from billiard.exceptions import WorkerLostError

    d, pool, _timer, unacked = dispatcher()
    restored: list[str] = []
    unacked.restore = lambda tags: restored.extend(tags)
    # Each job of a lost batch runs again alone (workers/batching/isolation.py; its Redis part
    # aside).
    d.settlement.failed_batch = lambda _model, requests, _exc, stopping: list(requests)
    child = Child(1)
    pool._pool = SimpleNamespace(_pool=[child], _all_inqueues={child.inqW_fd})
    state = d.leases.inflight.state
    receive(d, "a")  # to the child at once
    receive(d, "b"), receive(d, "c")  # buffered behind it
    assert len(pool.calls) == 1 and state.fetching

    pool._pool._pool.remove(child)  # it dies; its replacement loads its models
    pool._pool._all_inqueues.clear()
    try:
        raise WorkerLostError("killed")
    except WorkerLostError:
        pool.calls[0]["error_callback"](ExceptionInfo())
    assert sorted(restored) == ["tag-b", "tag-c"] and not state.fetching
    assert len(pool.calls) == 1 and len(d.scheduler) == 1  # a stays, to run alone here

    fresh = Child(2)
    pool._pool._pool.append(fresh)
    pool._pool._all_inqueues.add(fresh.inqW_fd)
    d.child_ready(fresh.pid)
    assert state.fetching
    assert [job.id for job in pool.calls[1]["args"][1]] == ["a"]
