"""What the API answers below Flask, on raw sockets: gunicorn's own errors are the API's JSON
envelope, proxy headers count only from configured proxies, and a body that trickles in is cut
off at its deadline (on the defaults: 30 s)."""
from __future__ import annotations

import json
import socket
import time

import pytest
import requests

from config import load_settings
from scripts.stack import start_web

DEFAULTS = load_settings(environ={})


def exchange(port: int, raw: bytes, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Send `raw`, read the answer to its end (the server closes), and split it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def port_of(api: str) -> int:
    return int(api.rsplit(":", 1)[1])


@pytest.mark.parametrize("raw, status, code", [
    (b"GARBAGE\r\n\r\n", 400, "malformed_request"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n", 400, "malformed_request"),
    (b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", 400, "malformed_request"),
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-H%d: v\r\n" % i for i in range(120)) + b"\r\n", 431,
     "request_header_fields_too_large"),
    (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
     b"Content-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400, "malformed_request"),
])
def test_gunicorns_own_errors_are_the_json_envelope(api, raw, status, code):
    got, headers, body = exchange(port_of(api), raw)
    assert got == status, body
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["code"] == code and error["message"]


def test_a_script_name_header_from_an_unconfigured_peer_is_ignored(api):
    raw = b"GET /healthz HTTP/1.1\r\nHost: x\r\nSCRIPT_NAME: /elsewhere\r\nConnection: close\r\n\r\n"
    status, headers, body = exchange(port_of(api), raw)
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_a_configured_proxys_script_name_is_honoured_and_a_wrong_one_is_400(stack):
    web = start_web(dict(stack.env, IQ_FORWARDED_ALLOW_IPS="127.0.0.1"), stack.workdir)
    try:
        port = web.extra["port"]
        status, _, body = exchange(port, b"GET /api/healthz HTTP/1.1\r\nHost: x\r\n"
                                         b"SCRIPT_NAME: /api\r\nConnection: close\r\n\r\n")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        status, headers, body = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                                               b"SCRIPT_NAME: /api\r\nConnection: close\r\n\r\n")
        assert status == 400 and headers["content-type"] == "application/json"
        assert "SCRIPT_NAME" in json.loads(body)["error"]["message"]
        assert requests.get(f"{web.extra['url']}/healthz", timeout=5).ok  # still serving
    finally:
        web.stop()


def closes_while_trickling(sock: socket.socket, within: float) -> bool:
    """Whether the server closes the connection while a byte a half second still comes."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            sock.sendall(b" ")
            if sock.recv(65536) == b"":
                return True
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def rest_of_answer(sock: socket.socket, answer: bytes, within: float) -> tuple[bytes, bool]:
    """`answer` read on to its end (its Content-Length, or the server closing): the status
    line and the body may come in separate reads. Also whether the server closed."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        head, sep, body = answer.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        if sep and length is not None and len(body) >= length:
            return answer, False
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return answer, True
        if not chunk:
            return answer, True
        answer += chunk
    return answer, False


def test_a_body_that_trickles_in_is_cut_off_at_its_deadline(api):
    """A byte every half second of a 1,000-byte job: 408 at body_timeout_s (30 s by default),
    in the JSON envelope, with `Connection: close`, while the API serves others."""
    limit = DEFAULTS.body_timeout_s
    with socket.create_connection(("127.0.0.1", port_of(api)), timeout=limit + 30) as sock:
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n")
        started = time.monotonic()
        answer = b""
        sock.settimeout(0.5)
        while not answer and time.monotonic() - started < limit + 20:
            try:
                sock.sendall(b" ")
                answer = sock.recv(65536)
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        elapsed = time.monotonic() - started
        answer, closed = rest_of_answer(sock, answer, within=10)
        assert requests.get(f"{api}/healthz", timeout=2).ok
        closed = closed or closes_while_trickling(sock, within=10)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    # The rest of that body is never read: the connection cannot carry another request, and
    # the answer says so.
    assert b"\r\nConnection: close\r\n" in answer.partition(b"\r\n\r\n")[0], answer[:300]
    assert closed
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "request_timeout"
    assert limit - 1 < elapsed < limit + 10, elapsed
