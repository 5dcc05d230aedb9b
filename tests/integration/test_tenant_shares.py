"""No API key takes another's share (issue 37, scaled down to run in seconds), on a stack with
one API process and a real worker: each attack of the issue is refused for the key that makes
it, and another key's submits are still served meanwhile.

* Jobs that expire at once, each keeping its request in Redis for a retry: the key's kept
  bytes stop at its quota (kept_bytes_per_key, 429 `kept_full`), not at Redis's memory guard.
* Listings that scan the key's whole index for a model it never used: each costs what its page
  may scan from the key's read budget (read_rate_per_key), 429 once it is spent.
* Request bodies trickled in on many connections: a key holds at most max_uploads_per_key of
  them; the next is refused at once, its connection closed.
* A waiting request (`?wait`, an event stream) whose client hangs up gives its wait slot back
  then, not when its wait or the stream's next heartbeat would have ended."""
from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import time

import pytest
import requests
import yaml

from bench.purposes import Monitor
from scripts.stack import launch, wait_until
from tasks.keys import KEPT_BY_BYTES_PREFIX

KEYS = {name: f"{name}-secret-key-0123456789" for name in (
    "alice", "mallory", "lister", "trickler", "waiter", "streamer", "hoarder", "auditor")}
QUOTA = 1_048_576  # kept bytes per key: ~34 of the requests below
READ_RATE, READ_BURST = 20, 600
UPLOADS = 4
BIG = ["x" * 10_000] * 3  # ~30 KB a request, as kept


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("shares")
    keys_file = workdir / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [
        {"name": name, "sha256": hashlib.sha256(secret.encode()).hexdigest()}
        for name, secret in KEYS.items()]}))
    models = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0},
              "idle": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}  # no worker
    stack = launch(workdir, models, {"w": ["quick"]}, ready_models=["quick"], env_extra={
        "IQ_API_KEYS_FILE": str(keys_file), "IQ_WEB_WORKERS": "1",
        "IQ_KEPT_INPUTS_MAX_BYTES": "65536", "IQ_KEPT_BYTES_PER_KEY": str(QUOTA),
        "IQ_READ_RATE_PER_KEY": str(READ_RATE), "IQ_READ_BURST_PER_KEY": str(READ_BURST),
        "IQ_MAX_UPLOADS_PER_KEY": str(UPLOADS), "IQ_MAX_WAITS_PER_KEY": "1"})
    yield stack
    stack.stop()


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def call(stack, method: str, path: str, who: str, **kw) -> requests.Response:
    return requests.request(method, f"{stack.api}{path}", headers=auth(who), timeout=10, **kw)


def served(stack, who: str = "alice") -> None:
    """Another key submits and its job succeeds (polled: no wait slot taken)."""
    r = call(stack, "POST", "/v1/jobs", who, json={"model": "quick", "inputs": ["mine"]})
    assert r.status_code == 202, r.text
    wait_until(lambda: call(stack, "GET", f"/v1/jobs/{r.json()['id']}", who).json()["status"]
               == "succeeded", timeout=30, what="the other key's job to succeed")


def test_jobs_that_expire_at_once_keep_no_more_than_the_keys_quota(stack):
    refused = None
    for i in range(3 * QUOTA // 30_000):  # three quotas' worth, if nothing stopped them
        r = call(stack, "POST", "/v1/jobs", "mallory",
                 json={"model": "quick", "inputs": BIG, "timeout_s": 0.0001})
        if r.status_code != 202:
            refused = r
            break
    assert refused is not None, "every request was kept"
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "kept_full" and "kept_bytes_per_key" in error["message"]
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert QUOTA - 40_000 < int(stack.redis.get(KEPT_BY_BYTES_PREFIX + "mallory")) <= QUOTA
    served(stack)
    # What the key keeps is its own: the others' submits keep theirs.
    r = call(stack, "POST", "/v1/jobs", "alice", json={"model": "quick", "inputs": BIG,
                                                         "timeout_s": 0.0001})
    assert r.status_code == 202, r.text


def test_waiting_jobs_too_large_to_keep_count_against_the_keys_quota(stack):
    """Requests over kept_inputs_max_bytes are not kept for a retry, but while their jobs wait
    (here on a model no worker serves) their messages and records hold them whole: they count
    against the key's quota, 429 `kept_full` past it, and leave the books when the jobs end."""
    huge = ["y" * 10_000] * 10  # ~100 KB: over IQ_KEPT_INPUTS_MAX_BYTES (64 KiB)
    waiting, refused = [], None
    for _ in range(3 * QUOTA // 100_000):
        r = call(stack, "POST", "/v1/jobs", "hoarder", json={"model": "idle", "inputs": huge})
        if r.status_code != 202:
            refused = r
            break
        waiting.append(r.json()["id"])
    assert refused is not None, f"{len(waiting)} waiting jobs of ~100 KB all accepted"
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "kept_full"
    assert 8 <= len(waiting) <= 10, len(waiting)  # 1 MiB / ~100 KB
    held = int(stack.redis.get(KEPT_BY_BYTES_PREFIX + "hoarder"))
    assert QUOTA - 110_000 < held <= QUOTA
    served(stack)  # another key's are served meanwhile
    for job_id in waiting:
        assert call(stack, "POST", f"/v1/jobs/{job_id}/cancel", "hoarder").status_code == 200
    assert int(stack.redis.get(KEPT_BY_BYTES_PREFIX + "hoarder") or 0) == 0
    # One that runs and succeeds leaves the books too. Its worker's main process is held
    # while it is submitted, so that its charge is read before it can run and release it.
    worker = stack.workers["w"].proc.pid
    os.kill(worker, signal.SIGSTOP)
    try:
        r = call(stack, "POST", "/v1/jobs", "hoarder", json={"model": "quick", "inputs": huge})
        assert r.status_code == 202, r.text
        assert int(stack.redis.get(KEPT_BY_BYTES_PREFIX + "hoarder")) > 100_000
    finally:
        os.kill(worker, signal.SIGCONT)
    wait_until(lambda: call(stack, "GET", f"/v1/jobs/{r.json()['id']}", "hoarder").json()[
        "status"] == "succeeded", timeout=30, what="the large job to succeed")
    assert int(stack.redis.get(KEPT_BY_BYTES_PREFIX + "hoarder") or 0) == 0


def test_a_listing_costs_what_its_page_scans_from_the_keys_read_budget(stack):
    # The key's index has jobs for the filter to read through (none of them `idle`'s).
    for _ in range(3):
        assert call(stack, "POST", "/v1/jobs", "lister",
                    json={"model": "quick", "inputs": ["a"]}).status_code == 202
    scan = "/v1/jobs?model=idle&limit=100"  # reads up to 500 entries a page
    assert call(stack, "GET", scan, "lister").status_code == 200
    r = call(stack, "GET", scan, "lister")
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limited"
    assert "read_rate_per_key" in r.json()["error"]["message"]
    # 500 of 600 spent: another 500 are 400 / 20 = 20 s away.
    assert 15 <= int(r.headers["Retry-After"]) <= 21
    # A read of one job costs one: the key still has those.
    assert call(stack, "GET", "/v1/jobs?limit=5", "lister").status_code == 200
    assert call(stack, "GET", "/v1/models", "lister").status_code == 200
    served(stack)


def test_a_listing_is_charged_what_its_page_reads_and_reads_no_more(stack):
    """One function gives a page its budget of index entries and charges the listing for it:
    an unfiltered page reads its `limit` (plus the entry its cursor names), a dead-letter
    status filter scans that index (which holds failed, cancelled and expired alike) and is
    charged the scan, so that cheap-looking `limit=1` pages cannot take Redis's time."""
    for _ in range(6):
        r = call(stack, "POST", "/v1/jobs", "auditor", json={"model": "idle", "inputs": ["a"]})
        assert r.status_code == 202, r.text
        assert call(stack, "POST", f"/v1/jobs/{r.json()['id']}/cancel",
                    "auditor").status_code == 200
    monitor = Monitor(stack.redis_svc.extra["admin_url"])
    try:
        first = call(stack, "GET", "/v1/jobs?limit=1", "auditor")
        cursor = first.json()["next_cursor"]
        second = call(stack, "GET", f"/v1/jobs?limit=1&cursor={cursor}", "auditor")
        stack.admin.echo("listed")  # once MONITOR shows it, it has shown the pages' reads
        wait_until(lambda: b'"listed"' in b"".join(monitor.chunks), 10, "the ECHO in MONITOR")
    finally:
        lines = monitor.stop()
    assert first.status_code == second.status_code == 200
    assert len(first.json()["jobs"]) == len(second.json()["jobs"]) == 1
    reads = [re.findall(rb'"([^"]*)"', line)[2:4] for line in lines
             if b'"lrange" "iq:jobs:auditor"' in line.lower()]
    # Each page fetched at most two entries: [from, to], to - from <= 1.
    assert len(reads) == 2 and all(int(to) - int(at) <= 1 for at, to in reads), reads
    # The dead-letter index holds six cancelled jobs: a page of failed ones scans it.
    scan = "/v1/jobs?status=failed&limit=1"
    assert call(stack, "GET", scan, "auditor").status_code == 200  # 500 of 600
    r = call(stack, "GET", scan, "auditor")
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "rate_limited"


def answer_of(sock: socket.socket) -> bytes:
    """What the server sends on `sock` until it closes it (within the socket's timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_key_cannot_hold_more_trickling_bodies_than_its_share(stack):
    port = int(stack.api.rsplit(":", 1)[1])
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['trickler']}"
            "\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    socks = []
    try:
        for _ in range(UPLOADS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(head + b'{"model": ')  # and nothing more: a body that trickles
            socks.append(sock)

        def refused() -> list[requests.Response]:
            r = call(stack, "POST", "/v1/jobs", "trickler",
                     json={"model": "quick", "inputs": ["a"]})
            return [r] if r.status_code == 429 else []

        r, = wait_until(refused, timeout=20, what="the key's uploads to be at their cap")
        assert r.json()["error"]["code"] == "too_many_uploads" and r.headers["Retry-After"] == "1"
        # One more trickled body is answered at once, not at its body's deadline (30 s), and
        # its connection closed (gunicorn's keep-alive, 2 s, for the rest of its body).
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            sent = time.monotonic()
            extra.sendall(head + b'{"model": ')
            answer = answer_of(extra)
            assert time.monotonic() - sent < 8
        assert answer.startswith(b"HTTP/1.1 429") and b"too_many_uploads" in answer
        served(stack)
    finally:
        for sock in socks:
            sock.close()
    # Their connections gone, their slots are given back.
    wait_until(lambda: call(stack, "POST", "/v1/jobs", "trickler",
                            json={"model": "quick", "inputs": ["a"]}).status_code == 202,
               timeout=20, what="the key's upload slots to be given back")


def waiting(stack) -> int:
    """Requests parked waiting in the API process (its one process's gauge)."""
    for line in requests.get(f"{stack.api}/metrics", timeout=10).text.splitlines():
        if line.startswith("iq_waiting_requests "):
            return int(float(line.split()[1]))
    raise AssertionError("no iq_waiting_requests in /metrics")


def queue_depth(stack, model: str = "quick") -> int:
    for line in requests.get(f"{stack.api}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'iq_queue_depth{{model="{model}"}}'):
            return int(float(line.split()[1]))
    raise AssertionError(f"no iq_queue_depth of {model} in /metrics")


def refused_a_wait(stack, who: str, job_id: str) -> bool:
    r = call(stack, "GET", f"/v1/jobs/{job_id}?wait=0.1", who)
    return r.status_code == 429 and r.json()["error"]["code"] == "too_many_waits"


def test_a_long_poll_whose_client_hangs_up_gives_its_wait_slot_back(stack):
    job = call(stack, "POST", "/v1/jobs", "waiter", json={"model": "idle", "inputs": ["a"]})
    job_id = job.json()["id"]
    port = int(stack.api.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"GET /v1/jobs/{job_id}?wait=30 HTTP/1.1\r\nHost: x\r\n"
                 f"Authorization: Bearer {KEYS['waiter']}\r\n\r\n".encode())
    wait_until(lambda: waiting(stack) == 1, timeout=10, what="the long poll to wait")
    assert refused_a_wait(stack, "waiter", job_id)  # the key's one slot is held
    sock.close()
    gone = time.monotonic()
    wait_until(lambda: waiting(stack) == 0, timeout=5,
               what="the slot to be given back (30 s of wait left)")
    assert time.monotonic() - gone < 5
    assert call(stack, "GET", f"/v1/jobs/{job_id}?wait=0.1", "waiter").status_code == 200
    served(stack)


def test_a_submit_waiting_on_prefer_wait_whose_client_hangs_up_gives_its_slot_back(stack):
    port = int(stack.api.rsplit(":", 1)[1])
    body = b'{"model": "idle", "inputs": ["a"]}'
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 f"{KEYS['waiter']}\r\nPrefer: wait=30\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_until(lambda: waiting(stack) == 1, timeout=10, what="the submit to wait")
    sock.close()
    gone = time.monotonic()
    wait_until(lambda: waiting(stack) == 0, timeout=5,
               what="the slot to be given back (30 s of wait left)")
    assert time.monotonic() - gone < 5


def test_an_event_stream_whose_client_hangs_up_gives_its_wait_slot_back(stack):
    job = call(stack, "POST", "/v1/jobs", "streamer", json={"model": "idle", "inputs": ["a"]})
    job_id = job.json()["id"]
    stream = requests.get(f"{stack.api}/v1/jobs/{job_id}/events", headers=auth("streamer"),
                          stream=True, timeout=10)
    assert stream.status_code == 200
    lines = stream.iter_lines()  # kept: a generator dropped early closes the connection
    assert next(lines).startswith(b"retry:")  # the stream has begun
    assert waiting(stack) == 1 and refused_a_wait(stack, "streamer", job_id)
    stream.close()
    gone = time.monotonic()
    # Its next heartbeat is 15 s away: a write would notice only then.
    wait_until(lambda: waiting(stack) == 0, timeout=5,
               what="the stream's slot to be given back")
    assert time.monotonic() - gone < 5


def test_on_the_defaults_a_flood_of_jobs_that_expire_at_once_stays_within_the_keys_quota(
        tmp_path_factory):
    """The issue's attack as it was made: requests as large as are kept (~256 KiB), each job
    expiring at once, with every setting but the keys file at its default (Redis's maxmemory
    1 GiB): the key is refused at 64 MiB kept, Redis stays far from its memory guard, and
    another key's jobs are served meanwhile."""
    workdir = tmp_path_factory.mktemp("shares-defaults")
    keys_file = workdir / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [
        {"name": name, "sha256": hashlib.sha256(KEYS[name].encode()).hexdigest()}
        for name in ("alice", "mallory")]}))
    stack = launch(workdir, {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}},
                   {"w": ["quick"]}, defaults=True,
                   env_extra={"IQ_API_KEYS_FILE": str(keys_file)})
    try:
        before = stack.admin.info("memory")["used_memory"]
        large = ["x" * 10_000] * 25  # ~250 KB as kept: under kept_inputs_max_bytes
        codes = []
        for i in range(400):  # 100 MB if every request were kept
            r = call(stack, "POST", "/v1/jobs", "mallory",
                     json={"model": "quick", "inputs": large, "timeout_s": 0.0001})
            codes.append(r.status_code)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "kept_full", r.text
                break
            assert r.status_code == 202, r.text
            if i % 50 == 0:
                served(stack)
        assert codes[-1] == 429 and 240 <= len(codes) <= 280, codes  # 64 MiB / ~250 KB
        kept = int(stack.redis.get(KEPT_BY_BYTES_PREFIX + "mallory"))
        assert 64 * 2**20 - 300_000 < kept <= 64 * 2**20
        for _ in range(5):
            served(stack)
        # Once the worker has taken (and expired) them, what stays is the kept requests.
        wait_until(lambda: queue_depth(stack) == 0, timeout=60, what="the queue to drain")
        grown = stack.admin.info("memory")["used_memory"] - before
        assert grown < 100 * 2**20, grown  # far from 90 % of 1 GiB
    finally:
        stack.stop()
