"""billiard's semaphore tracker, started again when it is gone (`install`, at the pool's start
in the worker's main process).

billiard registers every named semaphore the worker's main process makes (each pool child's
queues have their locks) with one tracker process, through a pipe, so that names left behind
by a crash are unlinked. billiard starts that process once and writes to it ever after: once
it is gone (killed, or OOM-killed), the next registration (the queues of a child started in
place of one that exited) raises BrokenPipeError, which Celery takes for a lost broker
connection, so the worker reconnected every few seconds and never started the child again,
serving nothing. CPython's own resource tracker starts a new one in that case
(multiprocessing.resource_tracker, since 3.8); this does the same, and tells the new one the
names this process still holds, so none is left behind should the worker crash later."""
from __future__ import annotations

import logging
import os
import threading

from billiard import semaphore_tracker
from billiard.semaphore_tracker import SemaphoreTracker

logger = logging.getLogger(__name__)


class RestartingTracker(SemaphoreTracker):
    """billiard's tracker, which knows the names registered with it, and on a broken pipe
    starts a new tracker process and registers them there."""

    def __init__(self, fd: int | None = None) -> None:
        super().__init__()
        self._fd = fd  # the running tracker's pipe, when there is one already
        self._names: set[str] = set()
        self._started = 0  # trackers started in place of one gone
        self._restart_lock = threading.Lock()

    def register(self, name: str) -> None:
        self._names.add(name)
        self._send("REGISTER", name)

    def unregister(self, name: str) -> None:
        self._names.discard(name)
        self._send("UNREGISTER", name)

    def _send(self, cmd: str, name: str) -> None:
        started = self._started
        try:
            super()._send(cmd, name)
        except BrokenPipeError:
            # The new tracker is told every name held now: `name` too when registered,
            # not when unregistered (it is unlinked already).
            self._start_again(started)

    def _start_again(self, started: int) -> None:
        with self._restart_lock:
            if self._started != started:  # another thread started one since
                return
            self._started += 1
            dead, self._fd = self._fd, None
            if dead is not None:
                os.close(dead)
            held = sorted(self._names)
            for name in held:
                super()._send("REGISTER", name)
        logger.warning("billiard's semaphore tracker is gone: started a new one and "
                       "registered the %d semaphore(s) this process holds with it", len(held))


def install() -> RestartingTracker:
    """billiard's module-level tracker (whose functions billiard's semaphores, spawned
    children and forkserver call) replaced by a `RestartingTracker` taking over its pipe."""
    tracker = RestartingTracker(semaphore_tracker._semaphore_tracker._fd)
    semaphore_tracker._semaphore_tracker = tracker
    semaphore_tracker.ensure_running = tracker.ensure_running
    semaphore_tracker.register = tracker.register
    semaphore_tracker.unregister = tracker.unregister
    semaphore_tracker.getfd = tracker.getfd
    return tracker
