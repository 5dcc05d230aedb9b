"""A reload's turns in the worker (workers/batching/reload.py, workers/batching/turns.py), with
fake pools and a fake turn store standing in for Redis, without a surge (IQ_RELOAD_SURGE=false;
with one: tests/unit/test_reload_surge.py): two one-child workers on one queue retire their
children one after the other, the second only once the first's replacement is up; a worker with
another child serving needs no turn; a worker rolls back what it replaced when a load failed. (The
turn's Redis scripts, against a real Redis: tests/integration/test_reload_turns.py; two real
workers: tests/faults/test_reload_rolling.py.)"""
from __future__ import annotations

import os
from types import SimpleNamespace

import orjson

from tasks.keys import reload_failed_key
from tests.unit.test_dispatcher import dispatcher
from workers.child import pinned
class Child:
    """A pool process as Celery's prefork pool books it; `ready` once it said WORKER_UP."""

    def __init__(self, pid: int) -> None:
        self.pid, self.inqW_fd, self.stopped = pid, 100 + pid, False

    def _is_alive(self) -> bool:
        return not self.stopped

    def terminate_controlled(self) -> None:
        self.stopped = True


class Pool:
    """The AsynPool inside a prefork TaskPool, as far as workers/broker/pool.py looks."""

    def __init__(self, *pids: int) -> None:
        self._pool = [Child(p) for p in pids]
        self._all_inqueues = {c.inqW_fd for c in self._pool}
        self._busy_workers: set[int] = set()
        self._active_writes: set[int] = set()

    def child(self, pid: int) -> Child:
        return next(c for c in self._pool if c.pid == pid)

    def reap(self) -> None:
        """The pool takes the stopped children out."""
        self._pool = [c for c in self._pool if not c.stopped]

    def start(self, pid: int, ready: bool) -> Child:
        child = Child(pid)
        self._pool.append(child)
        if ready:
            self._all_inqueues.add(child.inqW_fd)
        return child

    def up(self, pid: int) -> None:
        self._all_inqueues.add(self.child(pid).inqW_fd)


class FakeTurns:
    """Turn keys as Redis holds them (queue -> worker), shared by the workers' turns."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}


class FakeTurn:
    """workers/batching/turns.py's Turn over FakeTurns (no TTL, no rate limit)."""

    def __init__(self, turns: FakeTurns, worker: str) -> None:
        self.turns, self.worker = turns, worker
        self.mine: list[str] = []
        self.waiting_for = ""

    @property
    def held(self) -> bool:
        return bool(self.mine)

    def take(self, queues: list[str]) -> bool:
        keys = self.turns.keys
        others = [keys[q] for q in queues if keys.get(q, self.worker) != self.worker]
        self.waiting_for = others[0] if others else ""
        if not others:
            keys.update((q, self.worker) for q in queues)
            self.mine = list(queues)
        return not others

    def renew(self) -> None:
        pass

    def release(self) -> None:
        for q in self.mine:
            self.turns.keys.pop(q, None)
        self.mine = []


def worker(name: str, turns: FakeTurns, *pids: int):
    d, _pool, _timer, _unacked = dispatcher()
    pool = Pool(*pids)
    d.consumer.pool = SimpleNamespace(_pool=pool, num_processes=len(pids))
    d.consumer.task_consumer = SimpleNamespace(queues=[SimpleNamespace(name="m")])
    d.consumer.hostname = name
    reloader = d.reloader
    reloader.turn = FakeTurn(turns, name)
    reloader.report = lambda: None  # no Redis here
    reloader.stale, reloader.state = set(pids), "reloading"
    reloader.surges = False  # IQ_RELOAD_SURGE=false: turns (tests/unit/test_reload_surge.py)
    return reloader, pool


def test_two_one_child_workers_on_a_queue_reload_one_after_the_other():
    turns = FakeTurns()
    a, pool_a = worker("a@h", turns, 1)
    b, pool_b = worker("b@h", turns, 2)

    a.step()
    b.step()
    assert a.retiring == 1 and pool_a.child(1).stopped
    assert b.retiring is None and not pool_b.child(2).stopped, "b serves while a reloads"
    assert b.turn.waiting_for == "a@h" and turns.keys == {"m": "a@h"}

    pool_a.reap()
    pool_a.start(11, ready=False)  # a's replacement loads its models
    for _ in range(3):
        a.step()
        b.step()
    assert a.retiring == 1 and not pool_b.child(2).stopped, "still: until a's new child is up"

    pool_a.up(11)  # WORKER_UP: a's new child serves
    a.step()
    assert a.retiring is None and a.state == "serving" and turns.keys == {}
    b.step()
    assert b.retiring == 2 and pool_b.child(2).stopped and turns.keys == {"m": "b@h"}

    pool_b.reap()
    pool_b.start(12, ready=True)
    b.step()
    assert b.state == "serving" and turns.keys == {}


def test_a_worker_with_another_child_serving_needs_no_turn():
    turns = FakeTurns()
    turns.keys["m"] = "other@h"  # another worker's turn now
    a, pool_a = worker("a@h", turns, 1, 2)

    a.step()
    first = a.retiring
    assert first in (1, 2) and pool_a.child(first).stopped, "its other child serves"
    pool_a.reap()
    pool_a.start(11, ready=True)
    a.step()  # its new child serves: the last old one goes too
    assert a.retiring == 3 - first and pool_a.child(3 - first).stopped
    assert not a.turn.held and turns.keys == {"m": "other@h"}
    pool_a.reap()
    pool_a.start(12, ready=True)
    a.step()
    assert a.state == "serving"


def test_a_worker_alone_on_its_queue_reloads_at_once():
    turns = FakeTurns()
    a, pool_a = worker("a@h", turns, 1)
    a.step()
    assert a.retiring == 1 and turns.keys == {"m": "a@h"}


class Markers:
    """The failed-load markers as Redis holds them (tasks/keys.py `reload_failed_key`)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.values.get(key)


def test_a_worker_rolls_back_the_children_it_replaced_when_another_worker_failed(monkeypatch):
    """Two children: one replaced on the new file (no turn needed), then another worker's new
    child records that it could not load it. This worker goes back to the previous file and
    revision, and replaces the child it had started on the new one; its other old child is
    never retired."""
    monkeypatch.delenv(pinned.ENV, raising=False)
    a, pool = worker("a@h", FakeTurns(), 1, 2)
    a.client = Markers()
    a.previous = ("old", b"models: {}\n", a.app.conf.iq_models)
    a.revision, a.begun_with = "new", {1, 2}
    a.watch()
    first = a.retiring
    other = 3 - first
    pool.reap()
    pool.start(11, ready=True)  # its replacement, on the new file, serves
    a.client.values[reload_failed_key("new")] = orjson.dumps(
        {"worker": "b@h", "error": "RuntimeError: no program", "at": 0})
    a.watch()
    assert (a.revision, a.state, a.refused_revision) == ("old", "refused", "new")
    assert "b@h" in a.error and "RuntimeError: no program" in a.error
    assert a.retiring == 11 and pool.child(11).stopped, "the child on the new file goes"
    assert orjson.loads(os.environ[pinned.ENV])["reload_from"] == "", "the old file, pinned"
    pool.reap()
    pool.start(21, ready=True)  # on the previous file again
    a.watch()
    assert a.retiring is None and not a.stale and not a.turn.held
    assert not pool.child(other).stopped, "the roll halted: its other old child still serves"
