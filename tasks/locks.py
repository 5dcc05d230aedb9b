"""A lock for a short critical section that never waits on I/O (a few counters, a clock read):
the interpreter's own lock even where gevent has patched `threading` (the API's gevent
worker), so that taking it costs a C call rather than gevent's lock in Python (about two
microseconds, several times a request). A greenlet cannot be switched out inside such a
section (nothing in it yields to gevent's hub), so the real lock never blocks the hub; real
threads (gunicorn's gthread worker, a fan-out's threads there) are kept apart as by
`threading.Lock`. Never hold it across a Redis call, a sleep or another lock's wait."""
from __future__ import annotations

import _thread
import sys
from typing import Any


# The interpreter's allocate_lock, found on the first call (asking gevent for it took a few
# microseconds, once a request for the request's deadline).
_allocate: Any = None


def short_lock() -> Any:
    """A new unpatched lock (`_thread.allocate_lock` as it was before gevent's patching)."""
    global _allocate
    if _allocate is None:
        monkey = sys.modules.get("gevent.monkey")
        _allocate = monkey.get_original("_thread", "allocate_lock") if monkey is not None \
            else _thread.allocate_lock
    return _allocate()
