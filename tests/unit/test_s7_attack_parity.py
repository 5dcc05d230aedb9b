"""Session 7's outside attack on the API's fast paths, kept as seeded differential tests: each
fast path (web/'s Request, Parser and Reply; app/schemas.py JobBase.load;
app/jobs.py's Content-Type memo) is fed random and adversarial input and held to what the
general code it stands in for (gunicorn's own parser and response, marshmallow's own load,
werkzeug's is_json) makes of the same input, field for field and error for error."""
from __future__ import annotations

import random
from pathlib import Path

from gunicorn.config import Config
from gunicorn.http import message, wsgi
from gunicorn.http.parser import RequestParser
from gunicorn.http.unreader import IterUnreader
from marshmallow import Schema, ValidationError
from werkzeug.test import EnvironBuilder
from werkzeug.wrappers import Request as WerkzeugRequest

from web.answer import Reply
from web.request import Parser, Request
from web.worker import settle


NAMES = [b"Host", b"host", b"Content-Type", b"Content-Length", b"content-length",
         b"Transfer-Encoding", b"Expect", b"X-Forwarded-Proto", b"X-FORWARDED-PROTOCOL",
         b"X-Forwarded-Ssl", b"X-Forwarded-For", b"SCRIPT_NAME", b"X_A", b"X-A", b"Connection",
         b"Prefer", b"Authorization", b"", b"a b", b"!#$%&'*+-.^_`|~", b"X\xe9", b"x-\x00",
         b"Forwarded", b"Trailer", b"TE", b"Upgrade"]
VALUES = [b"", b"1", b"0", b"2", b"-1", b"+2", b"2,2", b"01", b"chunked", b"gzip, chunked",
          b"chunked, chunked", b"identity", b"Chunked", b"https", b"http", b"on", b"ssl",
          b"100-continue", b"100-Continue", b"close", b"keep-alive", b"wait=5",
          b"application/json", b"\xff\x80", b"a\x00b", b"a\rb", b"a\x0bb", b"a\x7f", b"\t",
          b" x ", b"\tx\t", b"a:b", b"\x85", b"\xa0x\xa0", b"1 ", b" 1", b"\xb2", b"\x1b"]
SEPARATORS = [b":", b": ", b":\t", b" :", b"\t:", b"::", b": \t "]
LINES = [b"POST /v1/jobs?x=1 HTTP/1.1", b"GET / HTTP/1.0", b"GET * HTTP/1.1",
         b"OPTIONS * HTTP/1.1", b"GET http://a/b?c HTTP/1.1", b"GET /%00%ff HTTP/1.1",
         b"POST /a HTTP/1.0", b"GET /a HTTP/2.0", b"get /a HTTP/1.1", b"GET /a#f HTTP/1.1"]
BODIES = [b"", b"{}", b"2\r\n{}\r\n0\r\n\r\n", b"0\r\n\r\n", b"abc",
          b"1;x=y\r\na\r\n0\r\nX: y\r\n\r\n", b"1\r\na\r\n0\r\nHost: h\r\n\r\n"]
SETTINGS = [{}, {"forwarded_allow_ips": "10.0.0.9"},
            {"forwarded_allow_ips": "*", "header_map": "refuse"},
            {"limit_request_fields": 3, "limit_request_field_size": 40},
            {"permit_obsolete_folding": True}, {"limit_request_fields": 5},
            {"forwarded_allow_ips": "*", "header_map": "dangerous",
             "forwarder_headers": "SCRIPT_NAME,X_A"}]
PEERS = [("10.0.0.9", 1), ("1.2.3.4", 2), "unix"]


def configs() -> list[Config]:
    made = []
    for settings in SETTINGS:
        cfg = Config()
        for name, value in settings.items():
            cfg.set(name, value)
        settle(cfg)
        made.append(cfg)
    return made


def field(rng: random.Random) -> bytes:
    if rng.random() < 0.05:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 12)))
    value = rng.choice(VALUES)
    if rng.random() < 0.1:
        value += bytes([rng.randrange(256)])
    return rng.choice(NAMES) + (rng.choice(SEPARATORS) if rng.random() < 0.3 else b": ") + value


def head(rng: random.Random) -> bytes:
    fields = [field(rng) for _ in range(rng.randrange(0, 8))]
    if fields and rng.random() < 0.1:
        fields.insert(rng.randrange(len(fields)), rng.choice([b" folded", b"\tf"]))
    return rng.choice(LINES) + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n"


def read(request_class, raw: bytes, cfg: Config, peer) -> tuple:
    """All a request class makes of `raw`: its parts, its body as read, its trailers, whether
    the connection closes after it; or the error (class and text) it raised."""
    try:
        req = request_class(cfg, IterUnreader([raw]), peer, 1)
    except Exception as e:  # noqa: BLE001 - the error is the result compared
        return type(e).__name__, str(e)
    try:
        body = req.body.read()
    except Exception as e:  # noqa: BLE001
        body = ("body refused", type(e).__name__, str(e))
    return (req.method, req.path, req.query, req.version, req.headers, req.scheme,
            type(req.body.reader).__name__, req._expected_100_continue, body, req.trailers,
            req.should_close())


def test_random_heads_read_as_gunicorns_parser_reads_them():
    rng = random.Random(7)
    cfgs = configs()
    for _ in range(1500):
        raw = head(rng) + rng.choice(BODIES)
        for cfg in cfgs:
            for peer in PEERS:
                assert read(Request, raw, cfg, peer) == \
                    read(message.Request, raw, cfg, peer), (raw, cfg.forwarded_allow_ips, peer)


def requests_on_a_connection(parser_class, stream: list[bytes], cfg: Config,
                             reads: list[str]) -> list:
    """Every request a parser reads from one connection's bytes, each body read as `reads`
    says (to its end, a part, or not at all: the parser discards the rest), until it stops."""
    parser = parser_class(cfg, iter(stream), ("10.0.0.9", 1))
    seen: list = []
    for how in reads:
        try:
            req = next(parser)
        except StopIteration:
            seen.append("stop")
            return seen
        except Exception as e:  # noqa: BLE001
            seen.append((type(e).__name__, str(e)))
            return seen
        try:
            body = req.body.read() if how == "all" else req.body.read(1) if how == "part" \
                else b""
        except Exception as e:  # noqa: BLE001
            body = (type(e).__name__, str(e))
        seen.append((req.method, req.path, req.headers, body, req.should_close()))
    return seen


PIPELINED = [
    b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabcde",
    b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"POST /d HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    b"GET /e HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nGET",
    b"GET /f HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"GET /g HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"POST /h HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /i HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",
    b"\r\nGET /j HTTP/1.1\r\nHost: x\r\n\r\n",
]


def test_pipelined_requests_read_as_gunicorns_parser_reads_them():
    """Requests one after another on a connection, their bodies read to the end, in part or
    not at all, the bytes given in pieces of random sizes: the same requests, the same bodies,
    and the same stop (Parser.finish_body skips only a body read to its end)."""
    rng = random.Random(11)
    cfg = configs()[0]
    for _ in range(1500):
        data = b"".join(rng.choice(PIPELINED) for _ in range(rng.randrange(1, 6)))
        cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randrange(0, 6))))
        stream = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
        reads = [rng.choice(["all", "part", "none"]) for _ in range(7)]
        assert requests_on_a_connection(Parser, stream, cfg, reads) == \
            requests_on_a_connection(RequestParser, stream, cfg, reads), (data, reads)


ANSWER_NAMES = ["Content-Type", "Content-Length", "content-length", "CONTENT-LENGTH",
                "Connection", "Upgrade", "Date", "Server", "X-A", "Keep-Alive", "TE",
                "Trailers", "Transfer-Encoding", "Proxy-Authorization", "X\x00", "X Y", "",
                "X\n", "\xc9", "Location", "upgrade", "connection"]
ANSWER_VALUES = ["", "1", "0", " 1", "1 ", "+5", "1_0", "-1", "x", "\xb2", "\u0661", "upgrade",
                 "websocket", "a\tb", "\t", " ", "a\x00", "a\n", "a\r", "\x7f", "\xe9",
                 "\u0100", "close", "a  b", "12345678901234567890", "1.0"]


def processed(response_class, headers, cfg: Config) -> tuple:
    req = message.Request(cfg, IterUnreader([b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"]),
                          ("1.1.1.1", 1), 1)
    resp = response_class(req, None, cfg)
    try:
        resp.process_headers(headers)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), resp.headers, resp.response_length, resp.upgrade
    return resp.headers, resp.response_length, resp.upgrade, resp.is_chunked()


def test_random_answer_headers_are_taken_as_gunicorns_response_takes_them():
    rng = random.Random(9)
    cfg = configs()[0]
    for _ in range(5000):
        headers = [(rng.choice(ANSWER_NAMES), rng.choice(ANSWER_VALUES))
                   for _ in range(rng.randrange(0, 5))]
        if headers and rng.random() < 0.05:
            headers[0] = (b"X", "1") if rng.random() < 0.5 else ("X", 1)
        assert processed(Reply, headers, cfg) == \
            processed(wsgi.Response, headers, cfg), headers


def test_random_jobs_load_as_marshmallows_own_load_loads_them():
    from app.schemas import _ENVELOPE, job_schema
    from config.models import parse_model

    models = {name: parse_model(name, raw, Path("/nonexistent")) for name, raw in {
        "f32": {"kind": "torchscript", "path": "m.pt", "input_shape": [2], "max_inputs": 4},
        "i64": {"kind": "torchscript", "path": "m.pt", "input_shape": [2],
                "input_dtype": "int64"},
        "txt": {"kind": "synthetic", "max_inputs": 2},
    }.items()}
    schemas = [job_schema(spec) for spec in models.values()] + [_ENVELOPE]
    values = [None, 0, 1, -1, 1.5, float("nan"), float("inf"), True, False, "", "x", "f32",
              "i64", "txt", [], {}, [1, 2], [[1, 2]], [[1, 2.5]], [[1, 2], [3, 4]],
              [[2**63, 0]], ["a"], ["a", "b", "c"], {"labels": ["a"]}, {"top_k": 1}, {"x": 1},
              "high", "low", "normal", "float", "base64", {"url": "http://example.com/h"},
              {"url": "http://example.com/h", "events": ["succeeded"]}, {"url": "ftp://x"},
              86400, 86400.1, 1e-9, "5", [[True, False]], [["1", 2]], 10**20, -0.0]
    keys = ["model", "inputs", "options", "timeout_s", "priority", "webhook",
            "encoding_format", "retry_of", "unknown", "Model"]
    rng = random.Random(5)

    def outcome(load, data):
        try:
            return "loaded", repr(load(data))
        except ValidationError as e:
            return "refused", repr(e.messages), repr(e.valid_data)

    for _ in range(4000):
        data = {key: rng.choice(values) for key in rng.sample(keys, rng.randrange(0, 6))}
        for schema in schemas:
            assert outcome(schema.load, data) == \
                outcome(lambda d, s=schema: Schema.load(s, d), data), (type(schema), data)


def test_content_types_past_the_memos_bound_are_answered_as_werkzeug_answers_them(
        monkeypatch):
    """Many distinct Content-Type values (a client making up a new one each request): the
    memo stays within MEMO_MOST, and every value past it is still answered right."""
    from app import jobs as app_jobs

    monkeypatch.setattr(app_jobs, "_JSON_TYPES", {})
    kinds = ["application/json", "application/x+json", "text/plain", "application/jsonx",
             "APPLICATION/JSON", "application/json; charset=latin-1", "multipart/form-data",
             "image/png", "", "application/vnd.api+json; q=1", "json", "application/ json"]
    for i in range(app_jobs.MEMO_MOST * 3):
        content_type = f"{kinds[i % len(kinds)]}; x={i}" if i % 5 else kinds[i % len(kinds)]
        served = WerkzeugRequest(EnvironBuilder(method="POST",
                                                content_type=content_type).get_environ())
        assert app_jobs._is_json(served) is served.is_json, content_type
        assert len(app_jobs._JSON_TYPES) <= app_jobs.MEMO_MOST
    assert len(app_jobs._JSON_TYPES) == app_jobs.MEMO_MOST
