"""A reload's surge and its rollback's order in the worker (workers/batching/reload.py,
workers/broker/pool.py), with a fake pool that sizes itself as billiard's does (`_processes`,
`grow`, `maintain_pool`) and asks the reload before it starts children in place of those
that exited, as `Pool._repopulate_pool` does; each child it starts keeps the models file
pinned when it started (workers/child/pinned.py), as a spawned child inherits it.

* One child (the default): a new child loads the new file beside it; the old one stops only
  once the new one serves, and the pool is back to one child. A new child that cannot load
  exits; the old one never stopped, and the pool is back to one child, none restarted.
* The rollback's order (finding M2): the child the pool starts after a failed one is started
  on the previous file, not on the failed one again, however the pool's restart and the
  reload's timer are ordered."""
from __future__ import annotations

import logging
import os

import orjson

from tasks.keys import reload_failed_key
from tests.unit.test_reload_turns import Child, FakeTurns, Markers, Pool, worker
from workers.child import pinned
OLD, NEW = b"models: {}\n# old\n", b"models: {}\n# new\n"


class SizedPool(Pool):
    """`Pool` with billiard's size: children are started up to `_processes`, each with the
    file pinned then; the reload is asked first (`before_children_start`)."""

    def __init__(self, *pids: int) -> None:
        super().__init__(*pids)
        self._processes = len(pids)
        self._putlock = None
        self.next_pid = 100
        self.before_children_start = None
        self.started_on: dict[int, str] = {}

    def grow(self, n: int = 1) -> None:
        self._processes += n

    def maintain_pool(self) -> None:
        self.reap()
        if self.before_children_start is not None:
            self.before_children_start()
        for _ in range(self._processes - len(self._pool)):
            self.next_pid += 1
            child = Child(self.next_pid)
            self._pool.append(child)
            self.started_on[child.pid] = pinned_file()

    def exits(self, pid: int) -> None:
        """A child exits (a failed load: its failure recorded first), the pool maintains."""
        self.child(pid).stopped = True
        self.maintain_pool()


def pinned_file() -> str:
    raw = orjson.loads(os.environ[pinned.ENV])
    import base64
    return "new" if base64.b64decode(raw["content"]) == NEW else "old"


def reloading(monkeypatch, *pids: int, surges: bool = True, name: str = "a@h",
              turns: FakeTurns | None = None):
    """A worker reloading from OLD to NEW with children `pids` on OLD."""
    monkeypatch.delenv(pinned.ENV, raising=False)
    a, _ = worker(name, turns or FakeTurns(), *pids)
    pool = SizedPool(*pids)
    a.consumer.pool._pool = pool
    pool.before_children_start = a.before_children_start
    a.client = Markers()
    a.surges = surges
    a.previous = ("old", OLD, a.app.conf.iq_models)
    a.revision, a.begun_with, a.content = "new", set(pids), NEW
    pinned.pin(NEW, reload_from="old")
    return a, pool


def fail_load(a, pool, pid: int) -> None:
    a.client.values[reload_failed_key("new")] = orjson.dumps(
        {"worker": "a@h", "error": "RuntimeError: not a model", "at": 0})
    pool.exits(pid)


def test_one_child_keeps_serving_until_the_new_one_serves(monkeypatch):
    a, pool = reloading(monkeypatch, 1)
    a.step()
    assert not pool.child(1).stopped, "the only child serves while the new one loads"
    assert pool._processes == 2 and [c.pid for c in pool._pool] == [1, 101]
    assert pool.started_on[101] == "new"
    for _ in range(3):
        a.step()
    assert not pool.child(1).stopped and a.state == "reloading"
    pool.up(101)  # WORKER_UP: the new child loaded the new file
    a.step()
    assert pool.child(1).stopped and pool._processes == 1, "then the old one goes, no other"
    pool.maintain_pool()
    assert [c.pid for c in pool._pool] == [101]
    assert a.state == "serving" and a.revision == "new" and not a.turn.held


def test_the_old_child_goes_only_after_its_batch(monkeypatch):
    a, pool = reloading(monkeypatch, 1)
    a.step()
    pool._busy_workers.add(pool.child(1).inqW_fd)
    pool.up(101)
    a.step()
    assert not pool.child(1).stopped and a.state == "reloading"
    pool._busy_workers.clear()  # its batch returned (the dispatcher steps the reload)
    a.step()
    assert pool.child(1).stopped and pool._processes == 1 and a.state == "serving"


def test_two_one_child_workers_on_a_queue_surge_one_after_the_other(monkeypatch):
    turns = FakeTurns()
    a, pool_a = reloading(monkeypatch, 1, turns=turns)
    b, pool_b = reloading(monkeypatch, 2, name="b@h", turns=turns)
    a.step()
    b.step()
    assert pool_a._processes == 2 and pool_b._processes == 1, "b waits for a's turn"
    assert b.turn.waiting_for == "a@h"
    pool_a.up(101)
    a.step()
    b.step()
    assert a.state == "serving" and pool_a._processes == 1 and pool_b._processes == 2


def test_a_surge_child_that_cannot_load_leaves_the_old_one_serving(monkeypatch):
    a, pool = reloading(monkeypatch, 1)
    a.step()
    fail_load(a, pool, 101)
    assert (a.revision, a.state, a.refused_revision) == ("old", "refused", "new")
    assert [c.pid for c in pool._pool] == [1] and not pool.child(1).stopped
    assert pool._processes == 1, "the pool back to one child: none restarted"
    for _ in range(3):
        a.watch()
    assert not pool.child(1).stopped and [c.pid for c in pool._pool] == [1]
    assert orjson.loads(os.environ[pinned.ENV])["reload_from"] == ""


def test_a_rollback_seen_by_the_timer_first_stops_the_loading_surge_child(monkeypatch):
    """Another worker's child failed: this worker's surge child, still loading, is stopped
    and the pool shrunk back; its old child serves on."""
    a, pool = reloading(monkeypatch, 1)
    a.step()
    a.client.values[reload_failed_key("new")] = orjson.dumps(
        {"worker": "b@h", "error": "RuntimeError: not a model", "at": 0})
    a.watch()
    assert a.state == "refused" and pool.child(101).stopped and pool._processes == 1
    pool.maintain_pool()
    assert [c.pid for c in pool._pool] == [1] and not a.stale


def test_the_child_started_after_a_failed_load_loads_the_previous_file(monkeypatch):
    """M2: two children, no surge needed. One is replaced; its replacement fails to load and
    exits before the reload's timer looked. The pool starts the next child on the previous
    file: the reload rolled back before the pool started it."""
    a, pool = reloading(monkeypatch, 1, 2)
    a.step()
    first = a.retiring
    pool.maintain_pool()  # its replacement, started on the new file
    new_child = max(pool.started_on)
    assert pool.started_on[new_child] == "new"
    fail_load(a, pool, new_child)  # the pool's restart comes before any timer tick
    restarted = max(pool.started_on)
    assert restarted != new_child and pool.started_on[restarted] == "old"
    assert a.state == "refused" and a.revision == "old"
    assert not pool.child(3 - first).stopped


def test_without_a_surge_the_only_child_goes_first_and_comes_back_on_the_previous_file(
        monkeypatch):
    a, pool = reloading(monkeypatch, 1, surges=False)
    a.step()
    assert pool.child(1).stopped and pool._processes == 1
    pool.maintain_pool()
    fail_load(a, pool, 101)
    assert pool.started_on[102] == "old" and a.state == "refused"


def test_the_worker_pool_asks_before_it_starts_children_and_sizes_after():
    """The real pool class (billiard's `_repopulate_pool` under workers/broker/pool.py's
    `Pool`): the callback runs before the pool reads its size, so a surge undone there
    (`end_surge`) starts no child; the default `_putlock` of an AsynPool is None-safe."""
    from types import SimpleNamespace

    from billiard.common import restart_state
    from billiard.pool import RUN

    from workers.broker.pool import Pool, before_children_start, end_surge

    class Gone:  # a pool process: the failed surge child, already reaped
        pid, index, inqW_fd = 7, 1, 9

        def _is_alive(self) -> bool:
            return True

    inner = Pool.__new__(Pool)
    started: list[int] = []
    old = Gone()
    old.pid, old.index = 6, 0
    for name, value in dict(_pool=[old], _processes=2, _putlock=None, _state=RUN,
                            _all_inqueues={9}, restart_state=restart_state(10, 1),
                            _create_worker_process=started.append).items():
        setattr(inner, name, value)
    pool = SimpleNamespace(_pool=inner)
    assert before_children_start(pool, lambda: end_surge(pool, {6}))
    inner._repopulate_pool([1])
    assert started == [] and inner._processes == 1, "the surge undone first: no child started"
    inner.before_children_start = None
    inner._processes = 2
    inner._repopulate_pool([1])
    assert started == [1], "without it, billiard starts one"


def test_a_rollback_that_ends_a_hold_hands_the_held_jobs_out(monkeypatch):
    """The CI bug (tests/faults/test_reload_gate.py): a reload removing `m` holds its jobs
    in the buffer while the surge child loads; the surge child cannot load, and the rollback
    serves `m` again. Its buffered jobs go to the old child then, with no job arriving to
    start the batching: the held jobs fill the worker's prefetch, so that none would, and
    the worker ran no batch again."""
    from tasks.names import task_name
    from tests.unit.test_dispatcher import receive

    monkeypatch.setenv("IQ_WORKER_MODELS", "")
    a, pool = reloading(monkeypatch, 1)
    d = a.dispatcher
    handed: list[list[str]] = []
    a.consumer.pool.apply_async = lambda fn, args, **kw: handed.append(
        [job.id for job in args[1]])
    a.app.tasks = {task_name("m"): object()}
    a.removed["m"], a.app.conf.iq_models = a.app.conf.iq_models["m"], {}  # the new file
    a.removing, a.stale = {"m"}, {1}
    a._hold(set())
    receive(d, "j1")
    receive(d, "j2")
    assert handed == [], "held while the reload removes m"
    a.step()  # a surge child loads the new file
    fail_load(a, pool, 101)
    assert a.state == "refused" and not d.scheduler.held
    d.consumer.timer.run_due()
    assert handed == [["j1", "j2"]], "the held jobs handed out once the hold ends"


def two_waiting(monkeypatch):
    """a and b, one child each on one queue, reloading: a's surge child loads, b waits for
    its turn. They share the failed-load markers, as one Redis."""
    turns = FakeTurns()
    a, pool_a = reloading(monkeypatch, 1, turns=turns)
    b, pool_b = reloading(monkeypatch, 2, name="b@h", turns=turns)
    b.client = a.client
    a.step()
    b.step()
    assert pool_a._processes == 2 and b.turn.waiting_for == "a@h"
    return turns, (a, pool_a), (b, pool_b)


def test_a_step_once_the_turn_is_back_asks_no_child_for_a_file_that_failed(monkeypatch,
                                                                           caplog):
    """The roll halts at the first failed load: a's surge child cannot load; a rolls back and
    gives its turn back. b's next step may come from a batch returned or a child up
    (PoolDispatcher), not from its timer's look at failures: it took the free turn and asked
    the pool for a surge child. The pool's look before it starts children
    (`before_children_start`) rolled back and started none, but b had logged that a surge
    child loads the failed file, and held the turn, holding up the other workers on its
    queues until its next step. Now it looks once it has the turn: no surge asked for, the
    turn given back at once."""
    turns, (a, pool_a), (b, pool_b) = two_waiting(monkeypatch)
    fail_load(a, pool_a, 101)
    a.step()
    assert a.state == "refused" and turns.keys == {}, "a gave its turn back"
    caplog.set_level(logging.INFO, logger="workers.batching.reload")
    caplog.clear()
    b.step()
    assert pool_b._processes == 1 and [c.pid for c in pool_b._pool] == [2], \
        "no child started on the failed file"
    assert (b.revision, b.state, b.refused_revision) == ("old", "refused", "new")
    assert "could not be loaded on worker a@h" in b.error
    assert "surge child loads" not in caplog.text, caplog.text
    assert turns.keys == {} and not b.turn.held and not b.stale
    assert orjson.loads(os.environ[pinned.ENV])["reload_from"] == ""


def test_the_undo_met_before_the_failure_replaces_no_child(monkeypatch, tmp_path):
    """The CI failure (tests/faults/test_reload_unloadable.py, 1 run in 4): `make reload`
    saw a's failed load and announced its undo, the old revision, and b's tick met that
    announcement before b's timer looked at the failure. b took the undo as a reload to
    the old file: a surge child loaded it and b's own child, on that file already, was
    stopped. b goes back instead: no child started, none stopped. (Real revisions here: the
    file on disk is the old one again, as after the undo.)"""
    from dataclasses import replace
    from types import SimpleNamespace

    from config.models import revision_of

    turns, (a, pool_a), (b, pool_b) = two_waiting(monkeypatch)
    old, new = revision_of(OLD), revision_of(NEW)
    path = tmp_path / "models.yaml"
    path.write_bytes(OLD)  # put back by the undo
    b.app.conf.iq_settings = replace(b.app.conf.iq_settings, models_file=str(path))
    b.consumer.timer.call_repeatedly = lambda *args: SimpleNamespace(cancel=lambda: None)
    b.previous, b.revision = (old, OLD, b.previous[2]), new
    b.client.values[reload_failed_key(new)] = orjson.dumps(
        {"worker": "a@h", "error": "RuntimeError: not a model", "at": 0})
    fail_load(a, pool_a, 101)  # (a's revisions are the fake ones): it rolls back
    a.step()
    assert turns.keys == {}

    b.begin(old, "2")  # the undo's announcement, from b's tick
    for _ in range(3):
        b.step()
        b.watch()
    assert pool_b._processes == 1 and [c.pid for c in pool_b._pool] == [2], \
        "its child, on the old file already, kept; none started"
    assert (b.revision, b.state, b.refused_revision) == (old, "refused", new)
    assert "could not be loaded on worker a@h" in b.error
    assert turns.keys == {} and not b.stale and b.content == OLD
