"""How the API's gunicorn (gevent) worker reads request bodies (app/wsgi.py installs it):

* under one deadline: a client that sends its body a byte at a time (a slow-loris body) is
  answered `408` once `body_timeout_s` has passed since the request reached the app, instead of
  holding its connection and greenlet for as long as it likes. gunicorn bounds the wait for a
  request's headers (its keep-alive timeout), not for its body. A gevent Timeout bounds each
  read as a whole, however many small pieces the body trickles in as. The 408 says
  `Connection: close` and gunicorn closes the connection once it is sent: the rest of the
  body is never read, so the connection cannot carry another request (web/answer.py's
  `OneSend.close_after_answer`);
* a body gunicorn cannot parse (a bad chunk size, a missing chunk terminator) is a `400`, not
  an error in the app.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import gevent
from gunicorn.http.errors import ParseException
from werkzeug.exceptions import BadRequest, RequestTimeout


class _Late(Exception):
    pass


class _GuardedInput:
    """`wsgi.input` whose every read must end by `deadline`. A body with a Content-Length
    (`length`: gunicorn refuses one that also says chunked) ends there: once that much is
    read, a read answers b"" as gunicorn's would, without a Timeout (werkzeug reads once more
    to find the end: a Timeout a request)."""

    def __init__(self, stream: Any, deadline: float, seconds: float,
                 length: int | None = None, server: Any = None) -> None:
        self._stream, self._deadline, self._seconds = stream, deadline, seconds
        self._left, self._server = length, server

    def _call(self, method: str, *args: Any) -> Any:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._late()
        marker = _Late()
        try:
            with gevent.Timeout(left, marker):
                return getattr(self._stream, method)(*args)
        except _Late as exc:
            if exc is not marker:
                raise
            raise self._late() from None
        except ParseException as exc:
            raise BadRequest(f"the request's body is malformed: {exc}") from None

    def _late(self) -> RequestTimeout:
        close = getattr(self._server, "close_after_answer", None)
        if close is not None:
            close()
        return RequestTimeout(f"the request's body did not arrive within {self._seconds:g}s")

    def read(self, *args: Any) -> bytes:
        left = self._left
        if left is None:
            return self._call("read", *args)
        if left <= 0:
            return b""
        data = self._call("read", *args)
        self._left = left - len(data)
        return data

    def readline(self, *args: Any) -> bytes:
        self._left = None  # counted by `read` alone
        return self._call("readline", *args)

    def readlines(self, *args: Any) -> list[bytes]:
        self._left = None
        return self._call("readlines", *args)

    def __iter__(self) -> Any:
        return iter(self.readline, b"")


class GuardedBodies:
    """A WSGI wrapper whose requests' bodies are read as the module docstring says."""

    def __init__(self, app: Callable, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        length = environ.get("CONTENT_LENGTH", "")
        environ["wsgi.input"] = _GuardedInput(
            environ["wsgi.input"], time.monotonic() + self.seconds, self.seconds,
            int(length) if length.isascii() and length.isdigit() else None,
            environ.get("gunicorn.socket"))
        return self.app(environ, start_response)
