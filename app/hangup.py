"""Notice, while a request waits (`?wait`, `Prefer: wait`, an event stream: app/store.py's
Watch), that its client has gone, so that its wait slot is given back then rather than when
the wait would have ended (up to max_wait_s later) or, for a stream, when its next heartbeat
found the connection closed (15 s on).

Under gunicorn's gevent worker a greenlet waits for the request's socket to turn readable: a
client that closed its connection makes it readable with nothing to read (EOF), and the wait's
Event is set with `gone`. A client that sends more bytes instead (a pipelined request) is still
there: the greenlet ends and notices nothing more. Outside gunicorn (a test client), for a
socket that is not gevent's, and for a TLS socket (gunicorn's own TLS; a proxy in front
terminates it usually), nothing is watched.
"""
from __future__ import annotations

import socket
import threading
from typing import Any

from flask import has_request_context, request


class Hangup:
    """`gone` is set once the client has gone; `stop()` ends the watching (idempotent)."""

    def __init__(self) -> None:
        self.gone = threading.Event()
        self._greenlet: Any = None

    def stop(self) -> None:
        if self._greenlet is not None:
            self._greenlet.kill(block=False)
            self._greenlet = None


def watch(wake: threading.Event) -> Hangup:
    """Start watching the current request's client: when it goes, `gone` and `wake` are set."""
    hangup = Hangup()
    sock = request.environ.get("gunicorn.socket") if has_request_context() else None
    kind = type(sock).__module__
    if sock is None or not kind.startswith("gevent") or "ssl" in kind:
        return hangup  # (TLS: a peek would read a record, not the connection's end)
    import gevent
    from gevent.socket import wait_read

    def _watch() -> None:
        while True:
            try:
                wait_read(sock.fileno())
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                    return  # more from a client still there
                break  # EOF: it closed its connection
            except (BlockingIOError, InterruptedError):
                continue  # woken with nothing to read
            except (OSError, ValueError):
                break  # reset, or closed: gone too
        hangup.gone.set()
        wake.set()

    hangup._greenlet = gevent.spawn(_watch)
    return hangup
