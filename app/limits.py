"""What one API key may take of an API process, beside its wait slots (app/waiter.py): its
reads' budget (`ReadBudget`) and the request bodies it may be sending at once (`Uploads`).

Both are held in the process, not in Redis: a read (a poll of GET /v1/jobs/<id>, most of the
API's traffic) costs no Redis command for its limit, and a Redis that is frozen or away cannot
hold or fail the check. The limits are per API process, as the wait slots are: gunicorn spreads
a key's connections over its processes.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable, Iterator


class OverBudget(Exception):
    """The key's read budget cannot pay this cost now; `wait_s`: until it can."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"read budget used up for {wait_s:.3f}s")
        self.wait_s = wait_s

    @property
    def retry_after(self) -> int:
        return max(1, math.ceil(self.wait_s))


class ReadBudget:
    """A token bucket per API key: `rate` units a second, up to `burst` saved. A read costs
    what it makes Redis read: 1 for a job, the index entries a page of a listing may scan for a
    listing (app/group_stores.py's Stores.scan_cost); a cost over `burst` is charged as `burst`, so
    that every read can pass once the bucket is full. `rate` 0: no limit. Buckets of keys that
    have refilled are dropped (at most one a key in use)."""

    def __init__(self, rate: float, burst: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    def charge(self, owner: str, cost: float) -> None:
        """Take `cost` from `owner`'s bucket, or raise OverBudget (taking nothing)."""
        if self.rate <= 0:
            return
        cost = min(cost, self.burst)
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(owner, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens < cost:
                self._buckets[owner] = (tokens, now)
                raise OverBudget((cost - tokens) / self.rate)
            self._buckets[owner] = (tokens - cost, now)
            if len(self._buckets) > 10_000:
                self._forget_full(now)

    def _forget_full(self, now: float) -> None:
        full = [k for k, (tokens, at) in self._buckets.items()
                if tokens + (now - at) * self.rate >= self.burst]
        for k in full:
            del self._buckets[k]


class NoUpload(Exception):
    """The key is sending as many request bodies at once as it may: 429 at once, the body
    unread (app/errors.py's TooManyUploads)."""


_FREE = nullcontext()  # Uploads.hold without a key or a cap: nothing to hold


class Uploads:
    """Request bodies being received at once, per API key (`per_key`; 0: no cap): a key that
    trickles many bodies holds its own share of the process's connections and greenlets, not
    everyone's. The whole body is under one deadline too (app/request_body.py)."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def held(self, owner: str) -> int:
        return self._held[owner]

    def hold(self, owner: str | None) -> AbstractContextManager[None]:
        """One of `owner`'s upload slots for the block (none taken without a key), or
        NoUpload at once. Without a key, or a limit, a block that does nothing rather than a
        generator's (several calls a submit)."""
        if not owner or self.per_key <= 0:
            return _FREE
        return self._slot(owner)

    @contextmanager
    def _slot(self, owner: str) -> Iterator[None]:
        with self._lock:
            if self._held[owner] >= self.per_key:
                raise NoUpload(f"this API key is already sending {self.per_key} request "
                               "bodies to this API process")
            self._held[owner] += 1
        try:
            yield
        finally:
            with self._lock:
                self._held[owner] -= 1
                if not self._held[owner]:
                    del self._held[owner]
