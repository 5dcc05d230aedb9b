"""What a submit no longer does at each request (issue 40, item 3: less Python a job in the
API), each asserted as a call not made, with the answers it gives unchanged. The API in-process
with Flask's test client, against a real Redis and no worker (as tests/integration/test_app.py)."""
from __future__ import annotations

import base64
import sys

import pytest
import redis
import yaml

from app import create_app
from app import jobs as app_jobs
from config import job_ids
from tests.support.calls import calls

MODELS = {"echo": {"kind": "synthetic", "max_inputs": 4}}
JOB = {"model": "echo", "inputs": ["a"]}


@pytest.fixture
def api(redis_server, tmp_path):
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": MODELS}))
    # In this process, under a profiler: a loaded host's stall is no 503 here (as in
    # test_app.py's `api`; the deadline is tested on the defaults, with Redis frozen).
    app = create_app({"redis_url": redis_server.extra["url"], "models_file": str(models),
                      "max_wait_s": 0.2, "redis_deadline_s": 30.0})
    client = app.test_client()
    assert client.post("/v1/jobs", json=JOB).status_code == 202  # warm
    yield client
    app.extensions["iq.store"].waiter.close()


def posted(api, answers, **kwargs):
    return lambda: answers.append(api.post("/v1/jobs", **kwargs))


def test_a_submit_without_a_query_string_parses_no_query(api):
    answers: list = []
    assert calls(posted(api, answers, json=JOB), "werkzeug/sansio/request.py", "args") == 0
    assert answers[0].status_code == 202
    # one with a query is refused as before (only image/* bodies take one)
    r = api.post("/v1/jobs?model=echo", json=JOB)
    fields = r.get_json()["error"]["fields"]
    assert r.status_code == 422 and "query parameters" in fields["model"][0]


def test_a_content_type_is_parsed_once_a_process(api):
    answers: list = []
    assert calls(posted(api, answers, json=JOB), "werkzeug/sansio/request.py",
                 "_parse_content_type") == 0
    assert answers[0].status_code == 202
    for content_type, status in [("application/json; charset=utf-8", 202),
                                 ("application/vnd.job+json", 202), ("APPLICATION/JSON", 202),
                                 ("text/plain", 415), ("application/jsonx", 415)]:
        for _ in range(2):
            r = api.post("/v1/jobs", data=b'{"model": "echo", "inputs": ["a"]}',
                         headers={"Content-Type": content_type})
            assert r.status_code == status, (content_type, r.get_json())


def test_a_prefer_header_is_read_once_a_process(api):
    answers: list = []
    prefer = {"Prefer": "respond-async, wait=0.01"}
    api.post("/v1/jobs", json=JOB, headers=prefer)
    made = 0

    def profile(frame, event, arg):
        nonlocal made
        if event in ("call", "c_call") and frame.f_code.co_name == "_preferred_wait":
            made += 1  # a call made within it: the header read, and looked up once

    sys.setprofile(profile)
    try:
        posted(api, answers, json=JOB, headers=prefer)()
    finally:
        sys.setprofile(None)
    assert made <= 4, made  # itself; environ.get, dict.get, min: no split, strip, partition
    assert answers[0].headers["Preference-Applied"] == "wait=0.01"
    for header, applied in [("wait=0.02", "wait=0.02"), ('wait="0.03"', "wait=0.03"),
                            ("wait=nan", None), ("wait=-1", None), ("wait=x", None),
                            ("handling=lenient", None), ("wait=1e9", "wait=0.2")]:
        for _ in range(2):
            r = api.post("/v1/jobs", json=JOB, headers={"Prefer": header})
            assert r.headers.get("Preference-Applied") == applied, header


def test_header_values_past_the_memos_bound_are_read_each_time(api, monkeypatch):
    monkeypatch.setattr(app_jobs, "MEMO_MOST", 2)
    monkeypatch.setattr(app_jobs, "_WAITS", {})
    for i in range(1, 6):
        r = api.post("/v1/jobs", json=JOB, headers={"Prefer": f"wait=0.0{i}"})
        assert r.headers["Preference-Applied"] == f"wait=0.0{i}"
    assert len(app_jobs._WAITS) == 2


def test_the_idempotency_key_is_read_without_werkzeugs_header_look_up(api):
    answers: list = []
    headers = {"Idempotency-Key": "order-7"}
    count = calls(posted(api, answers, json=JOB, headers=headers), "datastructures/headers.py",
                  caller="submit_job")
    assert count == 0
    again = api.post("/v1/jobs", json=JOB, headers=headers)
    assert again.get_json()["id"] == answers[0].get_json()["id"]


def test_a_submit_calls_nothing_of_pythons_base64_module(api):
    """The record's token (config/job_ids.py token_text) and the task message's body
    (tasks/messages.py) are base64 of binascii's, not base64.py's three calls each."""
    answers: list = []
    assert calls(posted(api, answers, json=JOB), "/base64.py") == 0
    assert answers[0].status_code == 202


def test_a_token_is_what_token_urlsafe_makes_of_the_same_bytes(monkeypatch):
    for raw in (b"\xfb\xff\xbf\x00\x01\x02", b"\xff" * 6, b"ab", b"", bytes(range(16))):
        monkeypatch.setattr(job_ids, "random_bytes", lambda size, raw=raw: raw)
        assert job_ids.token_text(len(raw)) == \
            base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def test_a_submit_names_the_served_queues_once_a_process_and_reads_its_answer_as_is(api):
    answers: list = []
    assert calls(posted(api, answers, json=JOB), "app/store.py", "<setcomp>") == 0
    assert calls(posted(api, answers, json=JOB), "tasks/jobstate.py", "<genexpr>") == 0
    assert [r.status_code for r in answers] == [202, 202]
