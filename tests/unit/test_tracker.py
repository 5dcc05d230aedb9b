"""billiard's semaphore tracker started again when it is gone (workers/broker/tracker.py), with
real tracker processes and real named semaphores: the new one is told every name still held,
so it unlinks them all when this process ends, as the first would have."""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import billiard
import psutil
import pytest
from billiard import semaphore_tracker
from billiard._ext import _billiard

from scripts.processes import wait_until
from workers.broker import tracker as tracker_module
from workers.broker.tracker import RestartingTracker

SEMAPHORE = 1


def trackers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children() if p.status() != psutil.STATUS_ZOMBIE
            and "semaphore_tracker" in " ".join(p.cmdline())]


def semaphore(n: int) -> str:
    name = f"/iq-test-{os.getpid()}-{n}"
    _billiard.SemLock(SEMAPHORE, 1, 1, name, False)
    return name


def exists(name: str) -> bool:
    return Path("/dev/shm", "sem." + name.lstrip("/")).exists()


def killed(tracker: psutil.Process) -> None:
    """SIGKILL, and wait for it to be dead (a zombie: nothing waited on it yet)."""
    tracker.kill()
    wait_until(lambda: tracker.status() == psutil.STATUS_ZOMBIE, 10, "the tracker to die")


def zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def held_elsewhere(lock) -> bool:
    """True when another thread than the caller's cannot take `lock` now."""
    took: list[bool] = []

    def probe() -> None:
        ok = lock.acquire(blocking=False)
        if ok:
            lock.release()
        took.append(ok)
    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return not took[0]


def test_a_dead_tracker_is_started_again_and_told_every_name_held(caplog):
    tracker = RestartingTracker()
    before = {p.pid for p in trackers()}
    held, dropped = semaphore(1), semaphore(2)
    tracker.register(held)
    tracker.register(dropped)
    _billiard.sem_unlink(dropped)
    tracker.unregister(dropped)
    first = [p for p in trackers() if p.pid not in before]
    assert len(first) == 1
    killed(first[0])

    made = semaphore(3)
    with caplog.at_level(logging.WARNING, logger=tracker_module.__name__):
        tracker.register(made)  # billiard's own: BrokenPipeError
    assert "semaphore tracker is gone" in caplog.text
    second = [p for p in trackers() if p.pid not in before]
    assert len(second) == 1 and second[0].pid != first[0].pid
    assert not zombie(first[0].pid), "the dead tracker was not reaped"
    tracker.unregister(made)  # and unlinked: the new tracker is told
    _billiard.sem_unlink(made)

    # This process "ends": the new tracker unlinks what is still registered with it.
    os.close(tracker._fd)
    second[0].wait(10)
    assert not exists(held), "the name held before the restart was left behind"


def test_the_check_reaps_a_dead_tracker_and_starts_another_told_every_name_held(caplog):
    tracker = RestartingTracker()
    held = semaphore(4)
    tracker.register(held)
    tracker.check()  # alive: nothing to do
    first = trackers()
    assert len(first) == 1 and tracker.started == 0
    killed(first[0])

    with caplog.at_level(logging.WARNING, logger=tracker_module.__name__):
        tracker.check()  # no registration: the check alone
    assert "semaphore tracker is gone" in caplog.text
    assert not zombie(first[0].pid), "the dead tracker was not reaped"
    second = trackers()
    assert len(second) == 1 and second[0].pid != first[0].pid

    os.close(tracker._fd)  # this process "ends": the new tracker unlinks the name held
    second[0].wait(10)
    assert not exists(held), "the name held before the tracker died was left behind"


def test_with_no_name_held_the_check_reaps_and_starts_none_until_a_registration():
    tracker = RestartingTracker()
    name = semaphore(5)
    tracker.register(name)
    _billiard.sem_unlink(name)
    tracker.unregister(name)
    first = trackers()
    killed(first[0])
    tracker.check()
    assert not zombie(first[0].pid) and not trackers() and tracker._fd is None
    tracker.register(made := semaphore(6))
    assert len(trackers()) == 1
    _billiard.sem_unlink(made)
    tracker.unregister(made)
    os.close(tracker._fd)


def test_every_write_to_the_tracker_and_its_close_happen_under_the_lock(monkeypatch):
    """A finalizer unregistering on another thread takes the same lock, so it never writes
    to a pipe closed (and its number reused) by a restart."""
    tracker = RestartingTracker()
    write, close = os.write, os.close
    pipes: set[int] = set()
    closes: list[int] = []
    outside: list[str] = []

    def spy_write(fd: int, data: bytes) -> int:
        if data.startswith((b"REGISTER:", b"UNREGISTER:")):
            pipes.add(fd)
            if not held_elsewhere(tracker._lock):
                outside.append(f"write {data!r}")
        return write(fd, data)

    def spy_close(fd: int) -> None:
        if fd in pipes:
            closes.append(fd)
            if not held_elsewhere(tracker._lock):
                outside.append(f"close {fd}")
        close(fd)

    monkeypatch.setattr(os, "write", spy_write)
    monkeypatch.setattr(os, "close", spy_close)
    held = semaphore(7)
    tracker.register(held)
    killed(trackers()[0])
    tracker.register(made := semaphore(8))  # a broken pipe: closed, replaced
    try:
        assert len(closes) == 1 and not outside, f"outside the lock: {outside}"
        killed(trackers()[0])
        tracker.check()  # closed, replaced
        _billiard.sem_unlink(made)
        tracker.unregister(made)
        assert len(closes) == 2 and not outside, f"outside the lock: {outside}"
    finally:
        monkeypatch.undo()
        os.close(tracker._fd)


def test_a_send_within_a_send_on_the_same_thread_is_sent_after_it(monkeypatch):
    """A semaphore's finalizer run by the garbage collector while this thread sends: no
    deadlock on the lock it holds, and its message follows."""
    tracker = RestartingTracker()
    write = os.write
    sent: list[bytes] = []
    inner = semaphore(9)

    def spy_write(fd: int, data: bytes) -> int:
        if data.startswith((b"REGISTER:", b"UNREGISTER:")):
            sent.append(data)
            if len(sent) == 1:
                tracker.register(inner)
        return write(fd, data)

    monkeypatch.setattr(os, "write", spy_write)
    thread = threading.Thread(target=tracker.register, args=(outer := semaphore(10),),
                              daemon=True)
    thread.start()
    thread.join(10)
    monkeypatch.undo()
    assert not thread.is_alive(), "deadlocked"
    assert sent == [f"REGISTER:{outer}\n".encode(), f"REGISTER:{inner}\n".encode()]
    os.close(tracker._fd)


def test_install_puts_it_where_billiards_semaphores_register(monkeypatch):
    for name in ("_semaphore_tracker", "ensure_running", "register", "unregister", "getfd"):
        monkeypatch.setattr(semaphore_tracker, name, getattr(semaphore_tracker, name))
    tracker = tracker_module.install()
    assert semaphore_tracker._semaphore_tracker is tracker
    lock = billiard.get_context("spawn").Lock()
    try:
        assert lock._semlock.name in tracker._names
    finally:
        del lock
    os.close(tracker._fd)


@pytest.fixture(autouse=True)
def _reap():
    yield
    wait_until(lambda: not trackers(), 10, "the test's trackers to exit")


def test_the_pool_looks_at_its_tracker_on_the_event_loop_once_however_often_registered():
    """The worker's loop registers the pool again at each reconnect: one repeating check,
    every CHECK_EVERY_S, the last one set."""
    from kombu.asynchronous import Hub

    from workers.broker.pool import TaskPool

    pool = TaskPool.__new__(TaskPool)  # as Celery's loop sees it once started
    pool._pool = object()  # no loop handlers of its own here
    pool.sem_tracker = RestartingTracker()
    hub = Hub()
    for _ in range(3):
        pool.register_with_event_loop(hub)
    live = [s for s in hub.timer.queue if not s.entry.canceled]
    assert len(live) == 1
    assert live[0].entry.fun.__wrapped__ == pool.sem_tracker.check
    assert abs(live[0].eta - (time.monotonic() + tracker_module.CHECK_EVERY_S)) < 1
    hub.close()
