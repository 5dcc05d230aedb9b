"""An API answer leaves in one `sendall` (web/worker.py's Worker, web/answer.py's OneSend):
gunicorn's own Worker.handle_request, its parser and its Response, on a socket that records its
calls.
gunicorn sent the head and the body in two."""
from __future__ import annotations

import os
import socket

import pytest
from gunicorn import http
from gunicorn.config import Config
from gunicorn.glogging import Logger

from web.answer import OneSend
from web.worker import Worker

REQUEST = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"


class Recorder:
    """A client socket that keeps what each call sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def sendall(self, data, *flags) -> None:
        self.sent.append(bytes(data))

    def send(self, data, *flags) -> int:
        self.sent.append(bytes(data))
        return len(data)

    def sendfile(self, file, offset=0, count=None) -> None:
        self.sent.append(b"<file>")

    def close(self) -> None:
        self.closed = True


def answer(app, request: bytes = REQUEST, client: Recorder | None = None) -> Recorder:
    """`request` answered by the API's gunicorn Worker with the WSGI `app` (on `client`)."""
    cfg = Config()
    worker = Worker(1, os.getpid(), [], None, 30, cfg, Logger(cfg))
    worker.wsgi, worker.alive = app, True
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(request)
        req = next(http.get_parser(cfg, ours, ("127.0.0.1", 1)))
        client = client or Recorder()
        try:
            worker.handle_request(("127.0.0.1", 8000), req, client, ("127.0.0.1", 1))
        except StopIteration:
            pass
    return client


def app_of(status: str, body: list[bytes], length: bool = True):
    def app(environ, start_response):
        headers = [("Content-Type", "application/json")]
        if length:
            headers.append(("Content-Length", str(sum(map(len, body)))))
        start_response(status, headers)
        return body
    return app


def test_an_answer_leaves_in_one_call():
    sent = answer(app_of("201 Created", [b'{"id": "1"}'])).sent
    assert len(sent) == 1
    assert sent[0].startswith(b"HTTP/1.1 201 Created\r\n")
    assert sent[0].endswith(b"\r\n\r\n" + b'{"id": "1"}')


def test_an_answer_without_a_body_sends_its_head():
    sent = answer(app_of("204 No Content", [], length=False)).sent
    assert len(sent) == 1 and sent[0].startswith(b"HTTP/1.1 204 No Content\r\n")


def test_a_large_body_follows_its_head_and_chunks_go_as_they_come():
    big = b"x" * (OneSend.JOINED + 1)
    sent = answer(app_of("200 OK", [big])).sent
    assert len(sent) == 2 and sent[0].endswith(b"\r\n\r\n") and sent[1] == big
    sent = answer(app_of("200 OK", [b"a", b"b"], length=False)).sent  # chunked
    assert sent[0].endswith(b"\r\n\r\n")  # a stream's head is not held (below)
    assert sent[1:] == [b"1\r\na\r\n", b"1\r\nb\r\n", b"0\r\n\r\n"]


def test_a_streamed_answers_head_leaves_though_its_first_write_is_empty():
    """gunicorn sends nothing for an empty chunk: held, the head would wait for the stream's
    next write, however long it took to come."""
    client = Recorder()
    seen: list[list[bytes]] = []

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/event-stream")])
        yield b""
        seen.append(list(client.sent))  # what the client had before the next write
        yield b"data: 1\n\n"

    sent = answer(app, client=client).sent
    assert len(seen[0]) == 1 and seen[0][0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert sent[1:] == [b"9\r\ndata: 1\n\n\r\n", b"0\r\n\r\n"]


@pytest.mark.parametrize("extra, calls", [(0, 1), (1, 2)])
def test_a_body_of_exactly_joined_bytes_leaves_with_its_head(extra, calls):
    body = b"x" * (OneSend.JOINED + extra)
    sent = answer(app_of("200 OK", [body])).sent
    assert len(sent) == calls and b"".join(sent).endswith(b"\r\n\r\n" + body)


def test_a_head_answer_sends_its_head_alone_once_done():
    sent = answer(app_of("200 OK", [b"{}"]), b"HEAD /x HTTP/1.1\r\nHost: t\r\n\r\n").sent
    assert len(sent) == 1 and sent[0].startswith(b"HTTP/1.1 200 OK\r\n")
    assert sent[0].endswith(b"Content-Length: 2\r\n\r\n")


def test_the_interim_100_continue_leaves_before_the_app_reads_the_body():
    """A client that sent `Expect: 100-continue` may wait for it before it sends its body:
    held with the answer's head, it would leave only with the answer, once the app had given
    up on the body (body_timeout_s)."""
    seen: list[list[bytes]] = []

    def app(environ, start_response):
        seen.append(list(client_of_app.sent))  # what the client had when the app began
        environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    client_of_app = Recorder()
    request = (b"POST /x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
               b"Content-Length: 2\r\n\r\n{}")
    sent = answer(app, request, client_of_app).sent
    assert seen == [[b"HTTP/1.1 100 Continue\r\n\r\n"]]
    assert len(sent) == 2 and sent[1].startswith(b"HTTP/1.1 200 OK\r\n")
    assert sent[1].endswith(b"\r\n\r\nok")


def test_an_interim_answer_is_never_held():
    """One sent by `sendall` (gunicorn sends its 100 Continue by `send`, above) leaves at
    once, and the answer's head after it is still held for its body."""
    client = Recorder()
    out = OneSend(client)
    out.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert client.sent == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    out.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    out.sendall(b"ok")
    assert client.sent[1:] == [b"HTTP/1.1 200 OK\r\n\r\nok"]


def test_any_other_use_of_the_socket_sends_the_head_first():
    client = Recorder()
    out = OneSend(client)
    out.sendall(b"HTTP/1.1 200 OK\r\n\r\n")
    assert client.sent == []
    out.sendfile(None)
    assert client.sent == [b"HTTP/1.1 200 OK\r\n\r\n", b"<file>"]
    out.close()
    assert client.closed and out.client is client


class Counted(Recorder):
    """A client socket whose `send` takes at most `room` bytes a call, as a full buffer
    does, and that tells `send` calls from `sendall` ones."""

    def __init__(self, room: int = 1 << 30) -> None:
        super().__init__()
        self.room, self.calls = room, []

    def send(self, data, *flags) -> int:
        self.calls.append("send")
        taken = bytes(data[:self.room])
        self.sent.append(taken)
        return len(taken)

    def sendall(self, data, *flags) -> None:
        self.calls.append("sendall")
        super().sendall(data, *flags)


def test_an_answer_goes_by_one_send_not_sendall():
    """gevent's `sendall` asks the kernel for the socket's buffer size (a getsockopt) and
    runs its send loop for each call; an answer that one `send` takes costs neither."""
    client = answer(app_of("201 Created", [b'{"id": "1"}']), client=Counted())
    assert client.calls == ["send"]
    assert client.sent[0].endswith(b"\r\n\r\n" + b'{"id": "1"}')


def test_what_one_send_leaves_goes_by_sendall():
    body = b"x" * 5000
    client = answer(app_of("200 OK", [body]), client=Counted(room=1000))
    assert client.calls == ["send", "sendall"]
    whole = b"".join(client.sent)
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n") and whole.endswith(b"\r\n\r\n" + body)
    assert len(client.sent[0]) == 1000
