"""How the API's gunicorn worker writes an HTTP/1 answer (web/worker.py): `Reply`, gunicorn's
Response taking plain headers in one match and making the Date once a second, and `OneSend`,
the client's socket while an answer is written, which sends the head with the body."""
from __future__ import annotations

import re
import time

from gunicorn import util
from gunicorn.http import wsgi

from web.request import NAME


class OneSend:
    """A client's socket while gunicorn answers one request on it (Worker.handle_request).
    gunicorn sends an answer's head (status line and headers) with one `sendall` and its
    body with the next: two system calls, two segments on the wire, and a client woken for
    a head without its body, a request. The head is held and leaves with the body's first
    bytes (up to `JOINED` of them; a larger body follows the head on its own), in one call;
    an answer without a body sends its head when the request is done (`flush`), and any
    other use of the socket (gunicorn's sendfile, a close) sends it first. An interim answer
    (`100 Continue`, which a client may wait for before it sends its body) is never held, and
    the answer's head after it still is. Nor is a streamed (chunked) answer's head: gunicorn
    sends nothing for an empty write of one, so a stream whose first write is empty would
    have its head held until its next, which may be long in coming. The app sees this object as
    `environ["gunicorn.socket"]`: `client` is the socket under it, and `close_after_answer`
    asks for the connection to be closed after this answer."""

    JOINED = 65536
    __slots__ = ("client", "_head", "_fresh", "_req")

    def __init__(self, client, req=None) -> None:
        self.client, self._head, self._fresh, self._req = client, None, True, req

    def close_after_answer(self) -> None:
        """gunicorn closes the connection once this answer is sent, and the answer's head says
        `Connection: close`: what the app asks when the rest of the request's body will never
        be read (app/request_body.py: a body past its deadline), so that the connection is
        not kept for a next request that would start inside that body."""
        if self._req is not None:
            self._req.must_close = True

    def sendall(self, data, *flags):
        head = self._head
        if head is not None:
            self._head = None
            if not flags and len(data) <= self.JOINED:
                return self._whole(head + data)
            self._whole(head)
        elif self._fresh and not flags and data[:5] == b"HTTP/":
            if data[8:10] == b" 1":  # an interim answer: its client may be waiting for it
                return self._whole(data)
            self._fresh = False
            if b"\r\nTransfer-Encoding: chunked\r\n" not in data:
                self._head = bytes(data)
                return None
        self._fresh = False
        if flags:
            return self.client.sendall(data, *flags)
        return self._whole(data)

    def _whole(self, data) -> None:
        """`sendall(data)`, tried first as one `send`: an answer is far smaller than the
        socket's buffer, and gevent's `sendall` asks the kernel for that buffer's size
        (a getsockopt) and runs its send loop for each call. What one send leaves goes
        by `sendall`, as before."""
        sent = self.client.send(data)
        if sent < len(data):
            self.client.sendall(memoryview(data)[sent:])

    def flush(self) -> None:
        head, self._head, self._fresh = self._head, None, False
        if head is not None:
            self._whole(head)

    def __getattr__(self, name):
        # The held head first. Nothing held yet (gunicorn's 100 Continue goes by `send`
        # before the answer), the answer's head that follows is still held.
        if self._head is not None:
            self.flush()
        return getattr(self.client, name)


# An answer's header as gunicorn's Response takes it unchanged (wsgi.process_headers): a name
# of RFC 9110's token, a value of its field-vchar, SP and HTAB (wsgi.HEADER_VALUE_RE) that
# starts and ends with neither of the last two; held as `name\0value`, joined by "\n".
_ANSWER_VALUE = r"(?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?"
_ANSWER_HEAD = re.compile(rf"{NAME}\0{_ANSWER_VALUE}(?:\n{NAME}\0{_ANSWER_VALUE})*")
_ANSWER_NAME = re.compile(rf"^({NAME})\0", re.MULTILINE)


class Reply(wsgi.Response):
    """gunicorn's HTTP/1 answer, its headers taken in fewer steps where they are plain, to the
    same result, and its Date header made once a second. gunicorn's `process_headers` checks
    each header in turn (two types, two matches, a strip, two lower-cases, a hop-by-hop
    look-up: ~10 calls a header). A list of plain headers (str names and values gunicorn
    accepts as they are, none hop-by-hop, at most one Content-Length) is checked joined, in
    one match; any other goes through gunicorn's, which refuses or sorts it as before."""

    _date = (0, "")  # (the second, its HTTP date)

    def process_headers(self, headers):
        if type(headers) is not list:
            return super().process_headers(headers)
        pairs = [(n, v) for n, v in headers if type(n) is str and type(v) is str]
        if len(pairs) != len(headers):
            return super().process_headers(headers)
        joined = "\n".join([f"{n}\0{v}" for n, v in pairs])
        if pairs and not _ANSWER_HEAD.fullmatch(joined):
            return super().process_headers(headers)
        names = _ANSWER_NAME.findall(joined.lower())
        if not util.hop_headers.isdisjoint(names):
            return super().process_headers(headers)
        if "content-length" in names:
            if names.count("content-length") > 1:
                return super().process_headers(headers)
            try:
                self.response_length = int(pairs[names.index("content-length")][1])
            except ValueError:
                return super().process_headers(headers)  # which raises it
        self.headers.extend(pairs)
        return None

    def default_headers(self):
        """gunicorn's, with the date made once a second (`util.http_date`, to the second)."""
        if self.upgrade:
            connection = "upgrade"
        elif self.should_close():
            connection = "close"
        else:
            connection = "keep-alive"
        now = int(time.time())
        second, date = Reply._date
        if second != now:
            second, date = Reply._date = (now, util.http_date(now))
        headers = [
            "HTTP/%s.%s %s\r\n" % (self.req.version[0], self.req.version[1], self.status),
            "Server: %s\r\n" % self.version,
            "Date: %s\r\n" % date,
            "Connection: %s\r\n" % connection
        ]
        if self.chunked:
            headers.append("Transfer-Encoding: chunked\r\n")
        return headers
