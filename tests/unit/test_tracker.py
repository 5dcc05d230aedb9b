"""billiard's semaphore tracker started again when it is gone (workers/broker/tracker.py), with
real tracker processes and real named semaphores: the new one is told every name still held,
so it unlinks them all when this process ends, as the first would have."""
from __future__ import annotations

import logging
import os
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
    first[0].kill()
    first[0].wait(10)

    made = semaphore(3)
    with caplog.at_level(logging.WARNING, logger=tracker_module.__name__):
        tracker.register(made)  # billiard's own: BrokenPipeError
    assert "semaphore tracker is gone" in caplog.text
    second = [p for p in trackers() if p.pid not in before]
    assert len(second) == 1 and second[0].pid != first[0].pid
    tracker.unregister(made)  # and unlinked: the new tracker is told
    _billiard.sem_unlink(made)

    # This process "ends": the new tracker unlinks what is still registered with it.
    os.close(tracker._fd)
    second[0].wait(10)
    assert not exists(held), "the name held before the restart was left behind"


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
