"""The dispatcher's order of things (workers/batching/dispatcher.py,
workers/batching/settlement.py), with a fake pool and timer: a freed child gets its next batch
before the last batch is acknowledged, and a batch's acks go to Redis together."""
from __future__ import annotations

import dataclasses

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
                               hostname="w@test", prefetch_multiplier=8,
                               initial_prefetch_count=8, qos=None)
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


def test_a_full_batch_is_handed_to_the_busy_child_ahead_as_its_batch_nears_its_end(
        monkeypatch):
    """`batches_ahead` (default 1): as the only child's batch nears its end (its model's usual
    time), the next full batch is handed to it (it waits in the child's pipe,
    workers/broker/pool.py HeldBatches), not before (a job of higher priority may still come);
    what is not full waits in the buffer for the child to be free, as before."""
    import workers.batching.dispatcher as dispatcher_module

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(dispatcher_module, "monotonic", lambda: clock.now)
    d, pool, timer, _unacked = dispatcher()
    d.settlement.accepted = lambda *_args: None  # Celery's books: not this test's
    assert d.settings.batches_ahead == 1
    receive(d, "warm")  # the model's usual batch time: 0.1 s
    pool.calls[0]["accept_callback"](1, 0.0)
    pool.calls[0]["callback"]([JobOutcome("warm", Outcome.SUCCEEDED, 0.1, 1)])

    receive(d, "a")  # to the idle child at once
    pool.calls[1]["accept_callback"](1, 0.0)
    for job_id in "bcde":
        receive(d, job_id)
    assert len(pool.calls) == 2  # full, but the child's batch has 0.1 s to run
    armed = [delay for delay, _fn, _args in timer.due if delay > 0.01]
    assert armed and abs(armed[-1] - (0.075 - 0.005)) < 1e-6  # its end, less the lead
    clock.now += 0.071
    d._on_timer()
    assert [job.id for job in pool.calls[2]["args"][1]] == ["b", "c", "d", "e"]  # ahead
    receive(d, "f")
    assert len(pool.calls) == 3  # one ahead at most, and only a full batch

    pool.calls[1]["callback"]([JobOutcome("a", Outcome.SUCCEEDED, 0.1, 1)])
    assert len(pool.calls) == 3  # the child runs b..e now: f still waits for it
    pool.calls[2]["callback"]([JobOutcome(j, Outcome.SUCCEEDED, 0.1, 1) for j in "bcde"])
    assert [job.id for job in pool.calls[3]["args"][1]] == ["f"]  # the child is free


def test_before_a_model_is_timed_nothing_goes_ahead():
    d, pool, _timer, _unacked = dispatcher()
    d.settlement.accepted = lambda *_args: None  # Celery's books: not this test's
    receive(d, "a")
    pool.calls[0]["accept_callback"](1, 0.0)
    for job_id in "bcde":
        receive(d, job_id)
    assert len(pool.calls) == 1


def busy_near_its_end(monkeypatch, **settings):
    """The only child runs a batch of a model timed at 0.1 s, 0.09 s in (past the lead), and
    a full batch waits."""
    import workers.batching.dispatcher as dispatcher_module

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(dispatcher_module, "monotonic", lambda: clock.now)
    d, pool, _timer, _unacked = dispatcher()
    d.settlement.accepted = lambda *_args: None  # Celery's books: not this test's
    d.settings = dataclasses.replace(d.settings, **settings)
    receive(d, "warm")
    pool.calls[0]["accept_callback"](1, 0.0)
    pool.calls[0]["callback"]([JobOutcome("warm", Outcome.SUCCEEDED, 0.1, 1)])
    receive(d, "a")
    pool.calls[1]["accept_callback"](1, 0.0)
    clock.now += 0.09
    for job_id in "bcde":
        receive(d, job_id)
    return d, pool


def test_near_its_end_a_full_batch_goes_ahead(monkeypatch):
    _d, pool = busy_near_its_end(monkeypatch)
    assert len(pool.calls) == 3


def test_with_batches_ahead_0_a_busy_child_is_handed_nothing(monkeypatch):
    d, pool = busy_near_its_end(monkeypatch, batches_ahead=0)
    assert len(pool.calls) == 2
    pool.calls[1]["callback"]([JobOutcome("a", Outcome.SUCCEEDED, 0.1, 1)])
    assert [job.id for job in pool.calls[2]["args"][1]] == ["b", "c", "d", "e"]


def test_no_batch_goes_ahead_while_a_reload_replaces_children(monkeypatch):
    """A child on the previous file must come to hold no batch to be stopped."""
    import workers.batching.dispatcher as dispatcher_module

    monkeypatch.setattr(dispatcher_module.Reloader, "replacing", property(lambda self: True))
    _d, pool = busy_near_its_end(monkeypatch)
    assert len(pool.calls) == 2


def test_with_two_children_a_child_that_holds_no_batch_takes_what_waits_at_once(monkeypatch):
    """The dispatcher reads the pool's idle children (workers/broker/pool.py HeldBatches), not
    its own count of batches handed: with child 1 running a batch and holding the next ahead,
    child 2, its own batch returned, holds none, and the job waiting goes to it at once (by
    its own count, two children and three batches, none was free: the job waited for child
    1's batches to end, with no timer armed)."""
    from collections import deque

    import workers.batching.dispatcher as dispatcher_module
    from workers.broker.pool import HeldBatches, Pool

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(dispatcher_module, "monotonic", lambda: clock.now)
    d, pool, timer, _unacked = dispatcher()
    d.settlement.accepted = lambda *_args: None  # Celery's books: not this test's
    first, second = Child(1), Child(2)
    inner = Pool.__new__(Pool)  # the pool's books, without its processes
    inner._pool, inner._all_inqueues = [first, second], {first.inqW_fd, second.inqW_fd}
    inner._busy_workers, inner._active_writes = HeldBatches(inner._all_inqueues), set()
    inner._busy_workers.depth = 2
    inner.outbound_buffer = deque()
    pool._pool, pool.num_processes = inner, 2
    pool.apply_async = lambda fn, args, **kw: (pool.calls.append({"args": args, **kw}),
                                               inner.outbound_buffer.append(args))

    def written_to(child: Child) -> None:  # the pool writes its next batch to the child
        inner.outbound_buffer.popleft()
        inner._busy_workers.add(child.inqW_fd)

    d._usual["m"] = 0.1  # the model's usual batch time
    receive(d, "a")  # no child busy: at once
    written_to(first)
    pool.calls[0]["accept_callback"](1, 0.0)
    receive(d, "b")  # a child busy: within max_wait_ms, to the other
    clock.now += 0.006
    d._on_timer()
    written_to(second)
    pool.calls[1]["accept_callback"](2, 0.0)
    clock.now += 0.09  # a's batch nears its end: the next full batch goes ahead, to child 1
    for job_id in "cdef":
        receive(d, job_id)
    assert [job.id for job in pool.calls[2]["args"][1]] == ["c", "d", "e", "f"]
    written_to(first)
    receive(d, "x")
    assert len(pool.calls) == 3  # every child holds a batch

    inner._busy_workers.release(second.inqW_fd)  # b returns: child 2 holds none
    pool.calls[1]["callback"]([JobOutcome("b", Outcome.SUCCEEDED, 0.1, 1)])
    assert [job.id for job in pool.calls[3]["args"][1]] == ["x"]  # at once, to child 2


def test_a_batch_taken_up_from_ahead_arms_the_timer_for_the_next_one(monkeypatch):
    """The batch a child held ahead is taken up as the last one returns; the next full batch
    is due to go ahead as it nears its end, with no job arriving meanwhile to look again (a
    closed loop whose clients all wait): its acceptance arms the timer."""
    import workers.batching.dispatcher as dispatcher_module

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(dispatcher_module, "monotonic", lambda: clock.now)
    d, pool, timer, _unacked = dispatcher()
    d.settlement.accepted = lambda *_args: None  # Celery's books: not this test's
    d.settlement.finish = lambda *_args: None  # nor its acks
    d._usual["m"] = 0.1  # the model's usual batch time
    receive(d, "a")
    pool.calls[0]["accept_callback"](1, 0.0)
    clock.now += 0.09
    for job_id in "bcdefghi":
        receive(d, job_id)
    assert [job.id for job in pool.calls[1]["args"][1]] == ["b", "c", "d", "e"]  # ahead
    pool.calls[0]["callback"]([JobOutcome("a", Outcome.SUCCEEDED, 0.1, 1)])
    timer.run_due()
    assert len(pool.calls) == 2  # f..i: one batch ahead at most, and b..e not yet taken up
    pool.calls[1]["accept_callback"](1, 0.0)  # the child takes b..e up
    armed = [delay for delay, _fn, _args in timer.due]
    assert armed and abs(armed[-1] - (0.075 - 0.005)) < 1e-6
    clock.now += 0.071
    timer.run_due()
    assert [job.id for job in pool.calls[2]["args"][1]] == ["f", "g", "h", "i"]


def test_a_fetchs_received_events_leave_together_before_its_jobs_are_batched(monkeypatch):
    d, pool, _timer, _unacked = dispatcher()
    order: list = []
    monkeypatch.setattr("workers.batching.dispatcher.send_task_events",
                        lambda eventer, type_, jobs: order.append((type_, [j for j, _ in jobs])))
    pool.apply_async = lambda fn, args, **kw: order.append(("batch", [j.id for j in args[1]]))
    for job_id in ("a", "b", "c"):
        request = FakeRequest(job_id)
        request._on_ack, _reject = d.settlement.callbacks(request.message)
        d.leases.hold(request.message)
        d.received(job_id, {"name": "m"})
        d.submit("m", request, pump=False)
    assert order == []  # none sent a message at a time
    d.pump()
    assert order == [("task-received", ["a", "b", "c"]), ("batch", ["a", "b", "c"])]
    d.pump()
    assert len(order) == 2  # each sent once


def test_a_succeeded_batchs_acks_go_together_not_through_each_requests_ack_callback():
    """A returned batch's succeeded jobs are acknowledged as the batch's (one round trip; none
    for those the finish acknowledged with their results), each request marked acknowledged
    as Celery's `Request.acknowledge` marks it, without a call a job through its `on_ack`."""
    d, pool, timer, unacked = dispatcher()
    requests = [receive(d, job_id) for job_id in "abc"]
    through_callbacks: list = []
    for request in requests:
        request._on_ack = lambda *_a, _id=request.id: through_callbacks.append(_id)
    pool.calls[0]["callback"]([JobOutcome("a", Outcome.SUCCEEDED, 0.1, 1)])
    timer.run_due()
    pool.calls[1]["callback"]([JobOutcome("b", Outcome.SUCCEEDED, 0.1, 1),
                               JobOutcome("c", Outcome.SUCCEEDED, 0.1, 1, acked=True)])
    timer.run_due()
    assert through_callbacks == []
    assert unacked.acked == [["tag-a"], ["tag-b"]]  # c: acknowledged by its finish already
    assert all(r.acknowledged for r in requests)
    assert len(d.leases) == 0  # every message released
