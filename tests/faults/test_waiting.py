"""Many waiting clients: they hold no thread, so the API keeps answering probes and submits
while they wait, and their number is capped per process and per key, past which a wait is
refused at once rather than queued. No worker serves the model here: its jobs cannot finish
until they are cancelled."""
from __future__ import annotations

import hashlib
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from scripts.stack import launch, start_web, wait_until

KEYS = {"a": "waiting-key-a-123456", "b": "waiting-key-b-654321"}
MODEL = "parked"
PROBE_BOUND_S = 5.0  # generous: this is not a benchmark (bench/waiters.py is)


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


@pytest.fixture(scope="module")
def parked(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("waiting")
    keys_file = workdir / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [
        {"name": who, "sha256": hashlib.sha256(key.encode()).hexdigest()}
        for who, key in KEYS.items()]}))
    stack = launch(workdir, {MODEL: {"kind": "synthetic", "max_queue_depth": 100_000}}, {},
                   env_extra={"IQ_API_KEYS_FILE": str(keys_file)}, ready_models=[])
    yield stack
    stack.stop()


def submit(api: str, who: str = "a") -> str:
    r = requests.post(f"{api}/v1/jobs", json={"model": MODEL, "inputs": ["x"]},
                      headers=auth(who), timeout=10)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def waiting(api: str) -> int:
    text = requests.get(f"{api}/metrics", timeout=10).text
    return int(float(re.search(r"^iq_waiting_requests (\S+)$", text, re.M).group(1)))


def timed(method: str, url: str, **kw) -> tuple[requests.Response, float]:
    started = time.monotonic()
    r = requests.request(method, url, timeout=30, **kw)
    return r, time.monotonic() - started


def wait_as_told(api: str, job_id: str) -> tuple[requests.Response, float, list[int]]:
    """A `?wait=30` on the job, sent again after a 503's Retry-After as the 503 tells a client
    to (on a stalled CI host, a wait of a burst of 200 once spent its 2 s Redis deadline before
    it parked); the last answer, the seconds since the first try and every try's status."""
    started, statuses = time.monotonic(), []
    for _ in range(3):
        r, _seconds = timed("GET", f"{api}/v1/jobs/{job_id}?wait=30", headers=auth("a"))
        statuses.append(r.status_code)
        if r.status_code != 503:
            break
        time.sleep(float(r.headers.get("Retry-After", 1)))
    return r, time.monotonic() - started, statuses


def test_two_hundred_waiters_do_not_block_probes_or_submits(parked):
    api = parked.api
    ids = [submit(api) for _ in range(200)]
    with ThreadPoolExecutor(200) as pool:
        waits = [pool.submit(wait_as_told, api, i) for i in ids]
        try:
            wait_until(lambda: waiting(api) == 200, 20, "200 parked waiters")
        except TimeoutError as exc:
            ended = [w.exception() or w.result()[2] for w in waits if w.done()]
            raise AssertionError(f"{exc}: {waiting(api)} parked; the statuses of the waits "
                                 f"that ended: {ended}") from None
        for path in ("/healthz", "/readyz", "/metrics", "/healthz", "/v1/models"):
            r, seconds = timed("GET", f"{api}{path}", headers=auth("a"))
            assert r.status_code in (200, 503) and seconds < PROBE_BOUND_S, (path, seconds)
        r, seconds = timed("POST", f"{api}/v1/jobs", json={"model": MODEL, "inputs": ["y"]},
                           headers=auth("a"))
        assert r.status_code == 202 and seconds < PROBE_BOUND_S, seconds
        assert not any(w.done() for w in waits), "a waiter returned before its job finished"
        # Cancelling wakes every waiter at once, long before its 30 s are up.
        for i in ids:
            assert requests.post(f"{api}/v1/jobs/{i}/cancel", headers=auth("a"),
                                 timeout=10).status_code == 200
        answers = [w.result(timeout=20) for w in waits]
    assert {r.json()["status"] for r, _, _ in answers} == {"cancelled"}
    assert max(seconds for _, seconds, _ in answers) < 25
    wait_until(lambda: waiting(api) == 0, 10, "every wait slot given back")


def test_half_sent_requests_do_not_block_probes(parked):
    """64 connections that send part of a request line and stop hold no thread either."""
    import socket

    port = parked.web.extra["port"]
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(64)]
    try:
        for s in stalled:
            s.sendall(b"GET /v1/jobs/x HTTP/1.1\r\nHost: a\r\nX-Slow: ")
        for _ in range(5):
            r, seconds = timed("GET", f"{parked.api}/healthz")
            assert r.status_code == 200 and seconds < PROBE_BOUND_S, seconds
    finally:
        for s in stalled:
            s.close()


def test_waits_past_the_caps_are_answered_at_once(parked):
    web = start_web(dict(parked.env, IQ_MAX_WAITS="5", IQ_MAX_WAITS_PER_KEY="3"),
                    parked.workdir)
    api = web.extra["url"]
    try:
        ids = {who: [submit(api, who) for _ in range(4)] for who in KEYS}
        with ThreadPoolExecutor(8) as pool:
            held = [pool.submit(timed, "GET", f"{api}/v1/jobs/{i}?wait=30", headers=auth("a"))
                    for i in ids["a"][:3]]
            wait_until(lambda: waiting(api) == 3, 20, "key a's three waits")
            # Key a is at its cap: its next wait is refused at once, with the job's status.
            r, seconds = timed("GET", f"{api}/v1/jobs/{ids['a'][3]}?wait=30",
                               headers=auth("a"))
            assert r.status_code == 429 and seconds < PROBE_BOUND_S
            assert r.json()["error"]["code"] == "too_many_waits"
            assert r.json()["error"]["status"] == "queued"
            assert int(r.headers["Retry-After"]) >= 1
            # An event stream is held like a wait, within the same caps.
            r, seconds = timed("GET", f"{api}/v1/jobs/{ids['a'][3]}/events", headers=auth("a"))
            assert r.status_code == 429 and seconds < PROBE_BOUND_S
            assert r.json()["error"]["code"] == "too_many_waits"
            # Prefer: wait is not applied: the usual 202 at once, and the job exists.
            r, seconds = timed("POST", f"{api}/v1/jobs", headers={**auth("a"),
                               "Prefer": "wait=30"}, json={"model": MODEL, "inputs": ["p"]})
            assert r.status_code == 202 and seconds < PROBE_BOUND_S
            assert "Preference-Applied" not in r.headers
            # Key b has slots of its own until the process's five are taken.
            held += [pool.submit(timed, "GET", f"{api}/v1/jobs/{i}?wait=30",
                                 headers=auth("b")) for i in ids["b"][:2]]
            wait_until(lambda: waiting(api) == 5, 20, "five waits in all")
            r, seconds = timed("GET", f"{api}/v1/jobs/{ids['b'][2]}?wait=30",
                               headers=auth("b"))
            assert r.status_code == 429 and seconds < PROBE_BOUND_S
            # A finished job needs no slot: it is answered even now.
            assert requests.post(f"{api}/v1/jobs/{ids['b'][3]}/cancel", headers=auth("b"),
                                 timeout=10).status_code == 200
            r = requests.get(f"{api}/v1/jobs/{ids['b'][3]}?wait=30", headers=auth("b"),
                             timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "cancelled"
            for who in KEYS:
                for i in ids[who]:
                    requests.post(f"{api}/v1/jobs/{i}/cancel", headers=auth(who), timeout=10)
            assert {f.result(timeout=20)[0].json()["status"] for f in held} == {"cancelled"}
        wait_until(lambda: waiting(api) == 0, 10, "every wait slot given back")
        r = requests.get(f"{api}/v1/jobs/{ids['a'][3]}?wait=1", headers=auth("a"), timeout=10)
        assert r.status_code == 200
    finally:
        web.stop()


def test_an_event_stream_holds_a_wait_slot_until_it_ends(parked):
    """A stream is a parked greenlet like a `?wait`: it holds one wait slot while it lasts,
    sends its job's moves as they happen, and gives the slot back when it ends."""
    job_id = submit(parked.api)
    with requests.get(f"{parked.api}/v1/jobs/{job_id}/events", headers=auth("a"),
                      stream=True, timeout=30) as stream:
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        wait_until(lambda: waiting(parked.api) == 1, 20, "the stream's wait slot")
        requests.post(f"{parked.api}/v1/jobs/{job_id}/cancel", headers=auth("a"), timeout=10)
        text = stream.text  # the stream ends after the job's final event
    assert re.findall(r"^event: (\w+)$", text, re.M) == ["queued", "cancelled"]
    wait_until(lambda: waiting(parked.api) == 0, 10, "the slot given back")


@pytest.mark.parametrize("stray", [b"", b"\xff\xfe done"], ids=["empty", "not-utf8"])
def test_parked_waiters_are_woken_after_a_stray_move_message(parked, stray):
    """A message on the moves channel that is not one of ours (anyone with the application's
    Redis user may publish there) ends neither the listener nor the waits parked on it: the
    jobs' finishes still wake their waiters at once, not at their `?wait`'s end."""
    from tasks.keys import MOVES_CHANNEL

    web = start_web(parked.env, parked.workdir)
    api = web.extra["url"]
    try:
        ids = [submit(api) for _ in range(20)]
        with ThreadPoolExecutor(20) as pool:
            waits = [pool.submit(timed, "GET", f"{api}/v1/jobs/{i}?wait=30", headers=auth("a"))
                     for i in ids]
            wait_until(lambda: waiting(api) == 20, 20, "20 parked waiters")
            assert parked.admin.publish(MOVES_CHANNEL, stray) >= 1
            for i in ids:
                assert requests.post(f"{api}/v1/jobs/{i}/cancel", headers=auth("a"),
                                     timeout=10).status_code == 200
            answers = [w.result(timeout=40) for w in waits]
        assert {r.json()["status"] for r, _ in answers} == {"cancelled"}
        assert max(seconds for _, seconds in answers) < 15, "woken only at the wait's end"
    finally:
        web.stop()
