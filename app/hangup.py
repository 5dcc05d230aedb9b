"""Notice, while a request waits (`?wait`, `Prefer: wait`, an event stream: app/store.py's
Watch), that its client has gone, so that its wait slot is given back then rather than when
the wait would have ended (up to max_wait_s later) or, for a stream, when its next heartbeat
found the connection closed (15 s on).

Under gunicorn's gevent worker a watcher of gevent's event loop (no greenlet of its own: a
greenlet spawned and killed a request cost ~0.05 ms of the API's CPU a job, issue 40) calls back
once the request's socket turns readable: a client that closed its connection makes it readable
with nothing to read (EOF), and the wait's Event is set with `gone`. A client that sends more
bytes instead (a pipelined request) is still there: the watching ends and notices nothing more. Outside gunicorn (a test client), for a
socket that is not gevent's, and for a TLS socket (gunicorn's own TLS; a proxy in front
terminates it usually), nothing is watched.
"""
from __future__ import annotations

import socket
import threading
from typing import Any

from flask import request


class Hangup:
    """`gone` is set once the client has gone; `stop()` ends the watching (idempotent)."""

    def __init__(self) -> None:
        self.gone = threading.Event()
        self._watcher: Any = None

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher.close()
            self._watcher = None


def watch(wake: threading.Event) -> Hangup:
    """Start watching the current request's client: when it goes, `gone` and `wake` are set."""
    hangup = Hangup()
    try:  # the request itself, once (not its proxy's attribute, nor a check of its context first)
        served = request._get_current_object()
    except RuntimeError:  # outside a request
        return hangup
    sock = served.environ.get("gunicorn.socket")
    sock = getattr(sock, "client", sock)  # the socket under web/answer.py's OneSend
    kind = type(sock).__module__
    if sock is None or not kind.startswith("gevent") or "ssl" in kind:
        return hangup  # (TLS: a peek would read a record, not the connection's end)
    from gevent import get_hub

    raw = getattr(sock, "_sock", sock)  # the OS socket under gevent's: a peek that never waits

    def readable() -> None:  # on the event loop: must not block or switch
        try:
            if raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                hangup.stop()  # more from a client still there
                return
        except (BlockingIOError, InterruptedError):
            return  # woken with nothing to read: keep watching
        except (OSError, ValueError):
            pass  # reset, or closed: gone too
        hangup.stop()  # EOF: it closed its connection
        hangup.gone.set()
        wake.set()

    hangup._watcher = get_hub().loop.io(sock.fileno(), 1)  # 1: readable
    hangup._watcher.start(readable)
    return hangup
