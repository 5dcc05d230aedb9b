"""billiard's semaphore tracker killed in a running worker, on the defaults (s6-attack1's
F1 and F2): each dead tracker is reaped, a new one is started within seconds (not only at
the next registration) and told every semaphore the worker holds, so a worker that crashes
or is restarted (SIGHUP) afterwards leaves none of them in /dev/shm. Runs counted from the
synthetic model's log."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from scripts.stack import launch, wait_until
from tests.faults.test_recovery import Watch, models, runs, submit_load
from tests.support.workers import pool_children
from workers.broker.tracker import CHECK_EVERY_S

pytestmark = pytest.mark.slow

#: A dead tracker is replaced within this (a check every CHECK_EVERY_S on a loaded machine).
REPLACED_S = 15 * CHECK_EVERY_S


def tracker_of(worker: psutil.Process) -> psutil.Process | None:
    found = [p for p in worker.children() if p.status() != psutil.STATUS_ZOMBIE
             and "semaphore_tracker" in " ".join(p.cmdline())]
    return found[0] if found else None


def zombies(worker: psutil.Process) -> set[int]:
    return {p.pid for p in worker.children() if p.status() == psutil.STATUS_ZOMBIE}


def sem_names(pid: int) -> set[str]:
    """The named semaphores a process has open (mapped from /dev/shm)."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {line[line.index("/dev/shm/"):].split()[0] for line in text.splitlines()
            if "/dev/shm/sem." in line}


def all_sems(worker: psutil.Process) -> set[str]:
    return sem_names(worker.pid).union(*(sem_names(p.pid) for p in worker.children()))


def replaced(worker: psutil.Process, old: psutil.Process, killed_at: float) -> psutil.Process:
    """The tracker started in place of `old`, killed at `killed_at` (monotonic)."""
    wait_until(lambda: tracker_of(worker) not in (None, old), REPLACED_S,
               f"a tracker in place of the killed {old.pid}", interval=0.05)
    print(f"tracker replaced {time.monotonic() - killed_at:.1f} s after its kill")
    return tracker_of(worker)


def none_left(names: set[str]) -> None:
    """Each of `names` unlinked from /dev/shm (by the tracker, once the worker is gone);
    those left are removed after the assertion's message is made."""
    try:
        wait_until(lambda: not any(os.path.exists(n) for n in names), 15,
                   "the worker's semaphores to be unlinked")
    except TimeoutError:
        left = sorted(n for n in names if os.path.exists(n))
        for n in left:
            os.unlink(n)
        pytest.fail(f"{len(left)} of {len(names)} semaphores left in /dev/shm: {left}")


@pytest.fixture
def stack(tmp_path):
    log = tmp_path / "runs.log"
    made = launch(tmp_path, models(log), {"w": ["slow"]}, defaults=True)
    made.runs_log = log
    yield made
    made.stop()


def test_each_killed_tracker_is_reaped_and_replaced_under_load(stack):
    """Three times under load: the tracker killed, then a pool child (new semaphores, a
    broken pipe if the check has not replaced the tracker yet). Every killed tracker is
    reaped (no zombie child of the worker), every job succeeds, only a killed child's batch
    runs twice, and the warm stop leaves no semaphore behind."""
    worker = psutil.Process(stack.workers["w"].proc.pid)
    watch = Watch(stack)
    accepted = submit_load(stack, watch, count=40)
    killed, seen = [], all_sems(worker)
    for _ in range(3):
        old = tracker_of(worker)
        assert old is not None
        killed.append(old.pid)
        killed_at = time.monotonic()
        old.kill()
        pool_children(worker)[0].kill()
        replaced(worker, old, killed_at)
        stack.finished(stack.submit("slow", ["probe"])["id"])
        seen |= all_sems(worker)
    wait_until(watch.all_terminal, 120, "every job terminal")
    wait_until(lambda: not zombies(worker) & set(killed), REPLACED_S,
               f"the killed trackers {killed} to be reaped")
    counted = runs(stack.runs_log)
    assert {stack.job(j)["status"] for j in accepted.values()} == {"succeeded"}
    assert {counted[text] for text in accepted} <= {1, 2}
    stack.workers["w"].stop()
    assert stack.workers["w"].proc.returncode == 0
    none_left(seen)


def test_a_worker_killed_after_its_tracker_leaves_no_semaphore(stack):
    """The tracker killed, then, once the worker's check has replaced it (no child started
    since, so nothing registered), the worker's main process SIGKILLed: the new tracker,
    told every name held, unlinks them all."""
    worker = psutil.Process(stack.workers["w"].proc.pid)
    assert stack.finished(stack.submit("slow", ["warm"])["id"])["status"] == "succeeded"
    names = all_sems(worker)
    assert names
    old, killed_at = tracker_of(worker), time.monotonic()
    old.kill()
    new = replaced(worker, old, killed_at)  # by the worker's check alone: nothing registered
    assert old.pid not in zombies(worker)
    children = pool_children(worker) + [new]
    worker.kill()
    psutil.wait_procs(children, timeout=30)
    none_left(names)
    assert runs(stack.runs_log)["warm"] == 1


def test_a_sighup_after_the_tracker_was_killed_leaves_no_semaphore(stack):
    """The tracker killed and replaced by the check, then SIGHUP under load (Celery's
    restart by exec, which runs no finalizer: the old process's tracker sees the pipe close
    and unlinks what it was told): every job succeeds once, and after the warm stop no
    semaphore of either process is left."""
    worker = psutil.Process(stack.workers["w"].proc.pid)
    assert stack.finished(stack.submit("slow", ["warm"])["id"])["status"] == "succeeded"
    seen = all_sems(worker)
    old, killed_at = tracker_of(worker), time.monotonic()
    old.kill()
    replaced(worker, old, killed_at)
    watch = Watch(stack)
    accepted = submit_load(stack, watch, count=40)
    os.kill(worker.pid, signal.SIGHUP)
    wait_until(watch.all_terminal, 240, "every job terminal")
    seen |= all_sems(worker)
    counted = runs(stack.runs_log)
    assert {stack.job(j)["status"] for j in accepted.values()} == {"succeeded"}
    assert {counted[text] for text in accepted} == {1}
    stack.workers["w"].stop()
    assert stack.workers["w"].proc.returncode == 0
    none_left(seen)
