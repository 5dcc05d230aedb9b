"""The API's HTTP/1 parser (web/request.py's Request and Parser, web/worker.py's
Worker.handle): every head is read to what gunicorn's own parser reads from it, or refused with
the same error; a plain head is read without gunicorn's per-line steps; a peer's trust is worked
out once."""
from __future__ import annotations

import hashlib
import inspect
import itertools
import socket

import pytest
from gunicorn.config import Config
from gunicorn import util
from gunicorn.http import message, wsgi
from gunicorn.http.parser import RequestParser
from gunicorn.http.unreader import IterUnreader
from gunicorn.workers.base_async import AsyncWorker

from web.answer import Reply
from web.request import Parser, Request
from web.worker import Worker, settle


def config(**settings) -> Config:
    cfg = Config()
    for name, value in settings.items():
        cfg.set(name, value)
    return cfg


def parsed(request_class, raw: bytes, cfg: Config, peer=("10.0.0.9", 4000)):
    """What `request_class` makes of `raw`: its method, path, headers and the body reader's
    kind and scheme, or the error it raised (its class and text)."""
    try:
        req = request_class(cfg, IterUnreader([raw]), peer, 1)
    except Exception as e:  # noqa: BLE001 - the error is the result compared
        return type(e).__name__, str(e)
    return (req.method, req.path, req.query, req.version, req.headers, req.scheme,
            type(req.body.reader).__name__, req._expected_100_continue)


FIELDS = [
    b"Host: api", b"Host: api:8000", b"Content-Type: application/json",
    b"Content-Length: 2", b"Content-Length: x", b"Content-Length: 2, 2",
    b"Accept:*/*", b"X-Trace:   padded \t ", b"X-Empty:", b"X-Latin: caf\xe9",
    b"Authorization: Bearer k", b"Prefer: wait=5", b"Connection: close",
    b"Expect: 100-continue", b"Expect: nonsense", b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip", b"X-Forwarded-Proto: https", b"X-Forwarded-Proto: http",
    b"SCRIPT_NAME: /x", b"X_Under: 1", b"Bad Header: y", b": novalue", b"NoColon",
    b"X-Ctl: a\x01b", b"X-Del: a\x7fb", b"X-Cr: a\rb", b"X-Lf: a\nb", b" folded", b"\tfolded",
    b"X-Tab:\tv\t", b"X-Long: " + b"v" * 9000, b"X-Uni\xe9: 1", b"Host: other",
    b"Content-Type: text/plain", b"X-Colon: a:b:c", b"X-Forwarded-For: 1.2.3.4",
]


def heads():
    """Request heads: every field alone, pairs of them, and some longer mixes."""
    line = b"POST /v1/jobs?x=1 HTTP/1.1\r\n"
    for field in FIELDS:
        yield line + field + b"\r\n\r\n{}"
    for a, b in itertools.combinations(FIELDS[:22], 2):
        yield line + a + b"\r\n" + b + b"\r\n\r\n{}"
    yield line + b"\r\n".join(b"X-H%d: v" % i for i in range(120)) + b"\r\n\r\n"
    yield line + b"\r\n".join(FIELDS[:4] + FIELDS[6:12]) + b"\r\n\r\n{}"
    yield b"GET /healthz HTTP/1.0\r\nHost: x\r\nX-A: 1\r\n\r\n"
    yield b"GET /healthz HTTP/1.1\r\n\r\n"


SETTINGS = [
    {},
    {"forwarded_allow_ips": "10.0.0.9"},
    {"forwarded_allow_ips": "*", "header_map": "refuse"},
    {"limit_request_fields": 3, "limit_request_field_size": 40},
    {"strip_header_spaces": True, "header_map": "dangerous"},
    {"permit_obsolete_folding": True},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_every_head_reads_as_gunicorns_parser_reads_it(settings):
    cfg = config(**settings)
    settle(cfg)
    ours = Request
    for raw in heads():
        assert parsed(ours, raw, cfg) == parsed(message.Request, raw, cfg), raw


def test_a_plain_head_is_read_without_gunicorns_steps_for_each_line(monkeypatch):
    """gunicorn decodes, matches and applies its header policy line by line (~13 calls a
    field); a plain head is decoded and matched once."""
    cfg = config()
    settle(cfg)
    calls: list[str] = []
    real = message.Message._apply_header_policy

    def counted(self, *args, **kwargs):
        calls.append("policy")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(message.Message, "_apply_header_policy", counted)
    raw = (b"POST /v1/jobs HTTP/1.1\r\nHost: api\r\nContent-Type: application/json\r\n"
           b"Content-Length: 2\r\nAuthorization: Bearer k\r\nPrefer: wait=5\r\n\r\n{}")
    req = Request(cfg, IterUnreader([raw]), ("127.0.0.1", 9), 1)
    assert req.headers[0] == ("HOST", "api") and len(req.headers) == 5
    assert calls == []


def test_a_peers_trust_is_worked_out_once(monkeypatch):
    cfg = config(forwarded_allow_ips="127.0.0.1")
    settle(cfg)
    asked: list[str] = []
    real = message._ip_in_allow_list

    def counted(ip, *rest):
        asked.append(ip)
        return real(ip, *rest)

    monkeypatch.setattr(message, "_ip_in_allow_list", counted)
    raw = b"GET /x HTTP/1.1\r\nHost: a\r\nX-Forwarded-Proto: https\r\n\r\n"
    schemes = [Request(cfg, IterUnreader([raw]), ("127.0.0.1", port), 1).scheme
               for port in (1, 2, 3)]
    other = Request(cfg, IterUnreader([raw]), ("127.0.0.2", 1), 1).scheme
    assert schemes == ["https"] * 3 and other == "http"
    assert asked == ["127.0.0.1", "127.0.0.2"]


def test_the_worker_parses_a_plain_connection_with_its_own_parser(monkeypatch):
    """Worker.handle: a plain connection's requests are made by `Request`; with TLS, gunicorn's
    own handle (and its parser) takes the connection."""
    made: list[type] = []
    real = RequestParser.__init__

    def noting(self, *args):
        made.append(type(self))
        real(self, *args)

    monkeypatch.setattr(RequestParser, "__init__", noting)
    from gunicorn.glogging import Logger

    cfg = config()
    settle(cfg)
    worker = Worker(1, 1, [], None, 30, cfg, Logger(cfg))
    worker.alive = True
    seen: list[tuple[str, list]] = []

    def app(environ, start_response):
        seen.append((environ["PATH_INFO"], environ["HTTP_X_A"]))
        start_response("200 OK", [("Content-Length", "2")])
        return [b"ok"]

    worker.wsgi = app
    listener, client = socket.socketpair()
    ours, theirs = socket.socketpair()
    with listener, client, theirs:
        theirs.sendall(b"GET /a HTTP/1.1\r\nHost: t\r\nX-A: 1\r\n\r\n"
                       b"GET /b HTTP/1.1\r\nHost: t\r\nX-A: 2\r\nConnection: close\r\n\r\n")
        worker.handle(listener, ours, ("127.0.0.1", 1))
        answers = b""
        while chunk := theirs.recv(65536):
            answers += chunk
    assert seen == [("/a", "1"), ("/b", "2")] and answers.count(b"HTTP/1.1 200 OK") == 2
    assert made == [Parser]


@pytest.mark.parametrize("read", [3, 2, 0])
def test_a_bodys_rest_is_discarded_before_the_next_request_only_when_there_is_one(monkeypatch,
                                                                               read):
    """gunicorn reads a body once more before the next request, to discard what the app left
    of it; a body the app read to its end is not read again. One left part-read, or unread,
    is still discarded, and the next request read where it starts."""
    from gunicorn.http import body

    reads: list[int] = []
    real = body.Body.read

    def counted(self, size=None):
        reads.append(size)
        return real(self, size)

    monkeypatch.setattr(body.Body, "read", counted)
    cfg = config()
    settle(cfg)
    raw = (b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc"
           b"GET /b HTTP/1.1\r\nHost: t\r\n\r\n")
    parser = Parser(cfg, [raw], ("127.0.0.1", 1))
    first = next(parser)
    got = first.body.read(read) if read else b""
    reads.clear()
    second = next(parser)
    assert got == b"abc"[:read] and (second.method, second.path) == ("GET", "/b")
    assert reads == ([] if read == 3 else [1024, 1024])


ANSWER_HEADERS = [
    [], [("Content-Type", "application/json"), ("Content-Length", "11")],
    [("Content-Type", "application/json"), ("Content-Length", "2"), ("Location", "/v1/jobs/x"),
     ("X-Request-ID", "r-1")],
    [("X-Pad", "  padded\t")], [("X-Empty", "")], [("X-Inner", "a b\tc")],
    [("Content-Length", "2"), ("Content-Length", "3")], [("Content-Length", "x")],
    [("Connection", "upgrade"), ("Upgrade", "websocket")], [("Connection", "close")],
    [("Date", "yesterday")], [("Server", "x")], [("Keep-Alive", "5")],
    [("Bad Name", "v")], [("X-Ctl", "a\rb")], [("X-Nl", "a\nb")], [("X-Null", "a\0b")],
    [("X-Uni", "caf\u00e9")], [("X-Wide", "\u0100")], [(b"X-Bytes", "v")], [("X-B", b"v")],
    [("X-List", "v"), ["X-L", "w"]], [("X-Latin\u00e9", "v")], [("x-lower", "v")],
]


def processed(response_class, headers):
    req = message.Request(config(), IterUnreader([b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"]),
                          ("1.2.3.4", 5), 1)
    resp = response_class(req, None, config())
    try:
        resp.process_headers(list(headers))
    except Exception as e:  # noqa: BLE001 - the error is the result compared
        return type(e).__name__, str(e)
    return resp.headers, resp.response_length, resp.upgrade


def test_every_answers_headers_are_taken_as_gunicorns_response_takes_them():
    for headers in ANSWER_HEADERS:
        assert processed(Reply, headers) == processed(wsgi.Response, headers), headers


def test_plain_answer_headers_are_taken_without_gunicorns_steps_for_each(monkeypatch):
    """gunicorn checks each header in turn, asking whether it is hop-by-hop; plain headers are
    checked joined, in one match."""
    asked: list[str] = []
    real = util.is_hoppish

    def counted(name):
        asked.append(name)
        return real(name)

    monkeypatch.setattr(util, "is_hoppish", counted)
    got = processed(Reply, ANSWER_HEADERS[2])
    assert got == (ANSWER_HEADERS[2], 2, False) and asked == []


def test_an_answers_date_is_made_once_a_second(monkeypatch):
    import time

    made: list[float] = []
    real = util.http_date
    monkeypatch.setattr(util, "http_date", lambda at=None: made.append(at) or real(at))
    now = [5000.2]
    monkeypatch.setattr(time, "time", lambda: now[0])
    req = message.Request(config(), IterUnreader([b"GET / HTTP/1.1\r\nHost: t\r\n\r\n"]),
                          ("1.2.3.4", 5), 1)

    def date_of():
        resp = Reply(req, None, config())
        resp.start_response("200 OK", [("Content-Length", "0")])
        return [line for line in resp.default_headers() if line.startswith("Date:")]

    first, again = date_of(), date_of()
    now[0] = 5001.0
    later = date_of()
    assert first == again == [f"Date: {real(5000)}\r\n"] and later == [f"Date: {real(5001)}\r\n"]
    assert made == [5000, 5001]


def test_an_answer_is_the_bytes_gunicorns_response_writes(monkeypatch):
    """A whole answer through the Worker, with `Reply` and with gunicorn's Response: the same
    bytes (the clock held)."""
    import time

    monkeypatch.setattr(time, "time", lambda: 7000.0)
    from gunicorn.glogging import Logger

    def app(environ, start_response):
        start_response("202 Accepted", [("Content-Type", "application/json"),
                                        ("Content-Length", "11"), ("Location", "/v1/jobs/1"),
                                        ("X-Pad", " p ")])
        return [b'{"id": "1"}']

    def answer(response_class):
        monkeypatch.setitem(Worker._answer.__globals__, "Reply", response_class)
        cfg = config()
        settle(cfg)
        worker = Worker(1, 1, [], None, 30, cfg, Logger(cfg))
        worker.wsgi, worker.alive = app, True
        ours, theirs = socket.socketpair()
        with ours, theirs:
            theirs.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            req = next(Parser(cfg, ours, ("127.0.0.1", 1)))
            try:
                worker.handle_request(("127.0.0.1", 8000), req, ours, ("127.0.0.1", 1))
            except StopIteration:
                pass
            ours.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := theirs.recv(65536):
                got += chunk
        return got

    ours = answer(Reply)
    theirs = answer(wsgi.Response)
    assert ours == theirs and ours.startswith(b"HTTP/1.1 202 Accepted\r\nServer: gunicorn\r\n")


# gunicorn's AsyncWorker.handle and handle_request, whose HTTP/1 paths Worker.handle and
# Worker._answer repeat with the API's parser and answer. A gunicorn that changes either fails
# here: read the new one, bring the Worker's in line, and take the new digest.
COPIED_SHA256 = {
    "handle": "6eb3b127e6ba7e84a17176c140262822b8bf5c64a235e00a22b6b85892609705",
    "handle_request": "913e17a9542aa70de504548c11064a2bbaef5bccca1a756f722606c4a493a2c0",
}


@pytest.mark.parametrize("name", sorted(COPIED_SHA256))
def test_gunicorns_methods_are_the_ones_the_worker_repeats(name):
    source = inspect.getsource(getattr(AsyncWorker, name))
    assert hashlib.sha256(source.encode()).hexdigest() == COPIED_SHA256[name]
