"""One deadline for a whole request's Redis work (the API's `redis_deadline_s`), as gRPC's
deadlines are carried through a call: set once where the request starts, and every Redis call
the request makes (waiting for a pooled connection, connecting and authenticating, each
command, a pipeline, each retry and its backoff, the calls a fan-out makes at once on every
Redis group) is given what is left of it rather than a timeout of its own. Per-call timeouts
add up (a pooled connection waited for, then a command; a read, then another): in the issue 37
game day, with one group's Redis frozen, 172 of its 330 answers took 2.1-3.2 s against a 2 s
deadline.

The deadline lives in a context variable: each request (a greenlet under gunicorn's gevent
worker, a thread elsewhere) has its own, and the threads a fan-out starts with a copy of the
request's context share it. What a request is asked to hold (a `?wait`, `Prefer: wait`), and
what has bounds of its own (reading the client's body, fetching and decoding its images, the
webhook URL's lookup) is `paused()`: that time does not count. A call outside any request
(the result listener, the queue gauge's reading, a worker) has no deadline here and keeps its
client's own timeouts (tasks/redis_client.py)."""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar
from typing import Callable

import redis

from tasks.locks import short_lock


class DeadlinePassed(redis.TimeoutError):
    """The request's deadline has passed: the call was not made (or not waited for further)."""


class Deadline:
    """A request's deadline: `seconds` from its start, paused time not counted. Shared by the
    threads of a fan-out (thread-safe: its lock is held only for a clock read and a sum,
    tasks/locks.py)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self._clock = seconds, clock
        self._at = clock() + seconds
        self._paused_since: float | None = None
        self._pauses = 0
        self._lock = short_lock()

    def remaining(self) -> float:
        """Seconds left (<= 0: passed). While paused, what was left when the pause began."""
        with self._lock:
            now = self._clock() if self._paused_since is None else self._paused_since
            return self._at - now

    def bound(self, timeout: float | None) -> float:
        """`timeout` (None: none) cut to what is left; raises DeadlinePassed when nothing is."""
        left = self.remaining()
        if left <= 0:
            raise DeadlinePassed(f"the request's deadline ({self.seconds:g}s) has passed")
        return left if timeout is None else min(timeout, left)

    def paused(self) -> _Pause:
        """The block's time does not count (nested pauses count once)."""
        return _Pause(self)

    def _pause(self) -> None:
        with self._lock:
            if self._pauses == 0:
                self._paused_since = self._clock()
            self._pauses += 1

    def _resume(self) -> None:
        with self._lock:
            self._pauses -= 1
            if self._pauses == 0 and self._paused_since is not None:
                self._at += self._clock() - self._paused_since
                self._paused_since = None


class _Pause:
    """A pause of `deadline` as a `with` block: a class rather than a generator's context
    manager, which costs several times as much, and a request pauses four times."""

    __slots__ = ("_deadline",)

    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        self._deadline._pause()

    def __exit__(self, *exc: object) -> None:
        self._deadline._resume()


_current: ContextVar[Deadline | None] = ContextVar("iq_redis_deadline", default=None)


def current() -> Deadline | None:
    """The deadline of the request this runs for; None outside a request."""
    return _current.get()


class _Within:
    """A request's deadline as a `with` block (`deadline`): a class, as `_Pause` is, for a
    block every request of the API runs in."""

    __slots__ = ("_deadline", "_token")

    def __init__(self, seconds: float) -> None:
        self._deadline = Deadline(seconds)

    def __enter__(self) -> Deadline:
        self._token = _current.set(self._deadline)
        return self._deadline

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)


def deadline(seconds: float) -> AbstractContextManager[Deadline]:
    """The block is one request: its Redis calls share `seconds`."""
    return _Within(seconds)


_OUTSIDE = nullcontext()  # a pause outside a request: nothing to pause


def paused() -> AbstractContextManager[None]:
    """The block's time does not count against the current request's deadline, if any."""
    found = _current.get()
    return _OUTSIDE if found is None else _Pause(found)


def bound(timeout: float | None) -> float | None:
    """`timeout` cut to what is left of the current request's deadline (unchanged outside a
    request); raises DeadlinePassed when nothing is left."""
    found = _current.get()
    return timeout if found is None else found.bound(timeout)
