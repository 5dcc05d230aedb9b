"""billiard's semaphore tracker, started again when it is gone (`install`, at the pool's start
in the worker's main process; `check`, every `CHECK_EVERY_S` on the worker's event loop).

billiard registers every named semaphore the worker's main process makes (each pool child's
queues have their locks) with one tracker process, through a pipe, so that names left behind
by a crash are unlinked. billiard starts that process once and writes to it ever after: once
it is gone (killed, or OOM-killed), the next registration (the queues of a child started in
place of one that exited) raised BrokenPipeError, which Celery takes for a lost broker
connection, so the worker reconnected every few seconds and never started the child again,
serving nothing. CPython's own resource tracker starts a new one in that case
(multiprocessing.resource_tracker, since 3.8); this does the same, and tells the new one the
names this process still holds. It keeps the tracker's pid and looks at it every few seconds
(a non-blocking `waitpid`, which also reaps a dead one: billiard never waits on it, so each
killed tracker stayed a zombie of the worker): a dead tracker is replaced within
`CHECK_EVERY_S`, not only at the next registration, so the semaphores of a worker that
crashes or is restarted (SIGHUP) a few seconds after its tracker died are unlinked all the
same. A broken pipe before that check starts it again at once.

Every write to the tracker's pipe, and its close and replacement, happens under billiard's
lock (`SemaphoreTracker._lock`, which billiard takes only to start the tracker): a finalizer
unregistering on another thread never writes to a closed pipe's number, which may have been
reused by then. The lock is re-entrant, and a message sent while this thread already sends
one (a semaphore's finalizer run by the garbage collector in the middle of a send) is queued
and sent by the outer call."""
from __future__ import annotations

import collections
import logging
import os
import sys
import threading

from billiard import semaphore_tracker, spawn, util
from billiard.compat import spawnv_passfds
from billiard.semaphore_tracker import SemaphoreTracker

logger = logging.getLogger(__name__)

#: How often the worker looks whether its tracker is still alive (seconds).
CHECK_EVERY_S = 2.0

_MAIN = "from billiard.semaphore_tracker import main;main(%d)"


def _spawn_tracker() -> tuple[int, int]:
    """A new tracker process, as billiard's `ensure_running` starts it: (its pipe's write end,
    its pid)."""
    fds = []
    try:
        fds.append(sys.stderr.fileno())
    except Exception:  # no stderr (billiard passes it when there is one)
        pass
    r, w = os.pipe()
    try:
        exe = spawn.get_executable()
        args = [exe, *util._args_from_interpreter_flags(), "-c", _MAIN % r]
        pid = spawnv_passfds(exe, args, fds + [r])
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    return w, pid


class RestartingTracker(SemaphoreTracker):
    """billiard's tracker, which knows the names registered with it and its process's pid,
    and starts a new tracker process, registering those names there, when the one it had is
    gone (`check`, or a broken pipe)."""

    def __init__(self, fd: int | None = None) -> None:
        super().__init__()
        self._lock = threading.RLock()  # for billiard's Lock: a send within a send (a finalizer)
        self._fd = fd  # the running tracker's pipe, when there is one already
        self._pid: int | None = None  # its pid, when this started it (not one taken over)
        self._exiting: set[int] = set()  # trackers gone from the pipe, not yet reaped
        self._names: set[str] = set()
        self._outbox: collections.deque[tuple[str, str]] = collections.deque()
        self._sending = False
        self.started = 0  # trackers started in place of one gone

    def ensure_running(self) -> None:
        with self._lock:
            if self._fd is None:
                self._fd, self._pid = _spawn_tracker()

    def register(self, name: str) -> None:
        self._send("REGISTER", name)

    def unregister(self, name: str) -> None:
        self._send("UNREGISTER", name)

    def _send(self, cmd: str, name: str) -> None:
        if len(name) > 512:  # billiard's bound: a write under PIPE_BUF is atomic
            raise ValueError("name too long")
        with self._lock:
            self._outbox.append((cmd, name))
            if self._sending:  # this thread is in a send already: it sends this one too
                return
            self._sending = True
            try:
                while self._outbox:
                    self._send_one(*self._outbox.popleft())
            finally:
                self._sending = False

    def _send_one(self, cmd: str, name: str) -> None:
        if cmd == "REGISTER":
            self._names.add(name)
        else:
            self._names.discard(name)
        self.ensure_running()
        try:
            self._write(f"{cmd}:{name}\n")
        except BrokenPipeError:
            # The new tracker is told every name held now: `name` too when registered,
            # not when unregistered (it is unlinked already).
            self._start_again(self._pid)

    def _write(self, line: str) -> None:
        msg = line.encode("ascii")
        written = os.write(self._fd, msg)
        assert written == len(msg)  # a pipe takes a write under PIPE_BUF whole

    def check(self) -> None:
        """The worker's look at its tracker (every `CHECK_EVERY_S`): a tracker that exited is
        reaped, and, when this process holds semaphores, another started and told their names.
        Trackers gone from a broken pipe before they exited are reaped here too."""
        with self._lock:
            self._exiting = {pid for pid in self._exiting if not _reaped(pid)}
            if self._pid is not None and _reaped(self._pid):
                self._start_again(None)

    def _start_again(self, dead: int | None) -> None:
        """Under the lock: the pipe of the tracker gone closed, and, with names held, a new
        tracker started and every name registered with it. `dead`: the old tracker's pid,
        not yet reaped (kept for `check` to reap), None when reaped or unknown."""
        if dead is not None and not _reaped(dead):
            self._exiting.add(dead)
        old, self._fd, self._pid = self._fd, None, None
        if old is not None:
            os.close(old)
        self.started += 1
        held = sorted(self._names)
        if held:
            self.ensure_running()
            for name in held:
                self._write(f"REGISTER:{name}\n")
        logger.warning("billiard's semaphore tracker is gone: %s", (
            f"started a new one and registered the {len(held)} semaphore(s) this process "
            "holds with it" if held else "this process holds no semaphore; a new one starts "
            "at the next registration"))


def _reaped(pid: int) -> bool:
    """True when `pid`, a child of this process, has exited (and is reaped now), or is no
    child of it (reaped by someone else)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


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
