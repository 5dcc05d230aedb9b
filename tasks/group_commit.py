"""Group commit: calls that arrive while one is on its way to Redis go together in the next
round trip, as a database's log writer takes every commit that waited behind the one it wrote.

There is no window: a call that finds none in flight is sent at once, alone, so that a lone
request never waits for company. Calls that arrive while one is in flight queue; when it
returns, the first of them is woken to send up to `most` of them (itself included) in one call,
and so on. Each waits at most for the call ahead of it and its own, bounded by the request's
Redis deadline (tasks/redis_deadline.py): one that runs out while still queued leaves the queue
and is told the deadline passed (its call was never sent); one whose group is on its way when
its deadline passes is told Redis did not answer in time (its call may have run), as a call of
its own would be. An error of a group's call (a dropped connection, a timeout) is every one of
its callers' error.

Only calls made within a request are grouped: outside one there is no deadline to bound the
wait, and the call is sent alone.

`gather` (the API's gevent worker: `gevent.sleep(0)`) lets whatever is already runnable run
before a group goes: requests whose bytes the event loop already read reach their submit and
join the group, rather than the first of a burst going alone and the rest in the next call. It
waits on no I/O and no clock: a lone call still goes at once (one turn of the ready greenlets),
and the work it lets run first would have run before its answer was read all the same."""
from __future__ import annotations

import threading
from typing import Any, Callable, Generic, Sequence, TypeVar

import redis

from tasks import redis_deadline
from tasks.locks import short_lock

T = TypeVar("T")
R = TypeVar("R")


class _Call(Generic[T]):
    __slots__ = ("item", "done", "result", "error", "group", "sent")

    def __init__(self, item: T) -> None:
        self.item = item
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.group: list[_Call[T]] | None = None  # set when it is to send this group
        self.sent = False  # its group is on its way (or answered)


class GroupCommit(Generic[T, R]):
    """`send(items)` makes one round trip for a list of items and returns one result each, in
    order. `submit(item)` is one item's result, sent alone or with others that waited."""

    def __init__(self, send: Callable[[Sequence[T]], list[R]], most: int = 32,
                 gather: Callable[[], None] | None = None) -> None:
        self.send, self.most, self.gather = send, most, gather
        self._lock = short_lock()  # list and flag changes only: never held across a wait
        self._queued: list[_Call[T]] = []
        self._busy = False
        self.calls = 0  # round trips made, and items sent: for tests and benchmarks
        self.items = 0

    def submit(self, item: T) -> R:
        call = _Call(item)
        if redis_deadline.current() is None:
            self._send([call])
            return self._answer(call)
        with self._lock:
            if self._busy:
                self._queued.append(call)
            else:
                self._busy, call.group = True, [call]
        if call.group is None:
            try:
                self._wait(call)
            except BaseException:
                # Its deadline passed while it queued (it has left the queue), or its
                # request ends (a greenlet killed): a group it was woken to send is sent all
                # the same, for the others in it.
                with self._lock:
                    if call in self._queued:
                        self._queued.remove(call)
                    leads = call.group is not None
                if leads:
                    self._lead(call, gather=False)
                raise
        if call.group is not None:
            self._lead(call)
        return self._answer(call)

    @staticmethod
    def _answer(call: _Call[T]) -> R:
        if call.error is not None:
            raise call.error
        return call.result

    def _wait(self, call: _Call[T]) -> None:
        """Until its group is answered or it is woken to send one; within the deadline."""
        try:
            woken = call.done.wait(redis_deadline.bound(None))
        except redis_deadline.DeadlinePassed:
            woken = False
        if woken:
            return
        with self._lock:
            if call.group is not None or call.done.is_set():
                return  # woken as the deadline passed: it leads, or it is answered
            if not call.sent:
                self._queued.remove(call)
                raise redis_deadline.DeadlinePassed(
                    "the request's deadline passed while its submit waited for the one "
                    "before it")
        raise redis.TimeoutError("Redis did not answer the group of submits this one was in "
                                 "within the request's deadline")

    def _lead(self, call: _Call[T], gather: bool = True) -> None:
        """Send `call`'s group (topped up with what queued while `gather` ran), then hand the
        queue to the first in it, or end the turn."""
        group = call.group or [call]
        stopped: BaseException | None = None
        if gather and self.gather is not None and len(group) < self.most:
            try:
                self.gather()
            except BaseException as exc:  # its greenlet killed: the group goes all the same
                stopped = exc
            with self._lock:
                more = self._queued[:self.most - len(group)]
                del self._queued[:len(more)]
                for member in more:
                    member.sent = True
            group = call.group = group + more
        try:
            self._send(group)
        finally:
            with self._lock:
                following = self._queued[:self.most]
                del self._queued[:self.most]
                for member in following:
                    member.sent = True
                if following:
                    following[0].group = following
                else:
                    self._busy = False
            if following:
                following[0].done.set()
        if stopped is not None:
            raise stopped

    def _send(self, group: list[_Call[T]]) -> None:
        """One round trip for the group; each member's result or error set, and woken."""
        for member in group:
            member.sent = True
        self.calls += 1
        self.items += len(group)
        try:
            results = self.send([member.item for member in group])
        except Exception as exc:  # noqa: BLE001 - each caller raises it as its own
            for member in group:
                member.error = exc
        else:
            for member, result in zip(group, results, strict=True):
                member.result = result
        for member in group:
            member.done.set()
