"""A job's answer leaves byte for byte the same whichever way it was made (issue 40 made the
`Prefer: wait` answer cheap: the job from its finish's announcement, read without a second
mapping, its headers leaving as the answer holds them, app/application.py Answer's
get_wsgi_response). For jobs that succeed, fail, are cancelled or expire, open and with API
keys, each answer (`Prefer: wait` answered and timed out into a 202, `?wait`, GET and HEAD) is
compared, status, headers in order and body, with the same answer made the general way: the
job read from its record (an idempotent repeat of the submit, a read) and the headers through
werkzeug's get_wsgi_headers. In-process (Flask's test client) on a real Redis; the worker's
part is played by JobState's own scripts, as a worker runs them."""
from __future__ import annotations

import hashlib
import json
import threading
import uuid

import pytest
import redis
import yaml
from werkzeug.wrappers import Response

from app import create_app
from app.application import Answer
from scripts.processes import wait_until
from tasks import results
from tasks.errors import ErrorCode, JobError
from tasks.jobstate import Final, JobState, StartDecision, Status, batch_text
from tasks.names import queue_lists

MODELS = {"echo": {"kind": "synthetic", "max_inputs": 4}}
KEY = "answer-bytes-key-1234"
TRACE = "answer-bytes-trace"


@pytest.fixture(params=["open", "keys"])
def api(request, redis_server, tmp_path):
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": MODELS}))
    settings = {"redis_url": redis_server.extra["url"], "models_file": str(models)}
    headers = {"X-Request-ID": TRACE}
    if request.param == "keys":
        keys = tmp_path / "keys.yaml"
        keys.write_text(yaml.safe_dump({"keys": [
            {"name": "team", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}))
        settings["api_keys_file"] = str(keys)
        headers["Authorization"] = f"Bearer {KEY}"
    app = create_app(settings)
    text = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    yield app.test_client(), headers, JobState(text, keep_s=600, ttl_s=600), text
    app.extensions["iq.store"].waiter.close()


def _bytes(answer) -> tuple[str, list[tuple[str, str]], bytes]:
    return answer.status, list(answer.headers.items()), answer.get_data()


def _general(monkeypatch, call):
    """`call`'s answer with its headers made through werkzeug's get_wsgi_headers."""
    with monkeypatch.context() as patched:
        patched.setattr(Answer, "get_wsgi_response", Response.get_wsgi_response)
        return _bytes(call())


def _queued(text: redis.Redis, seen: set[str]) -> str:
    """The id of the job queued now that is not in `seen`, once there is one."""
    found: list[str] = []

    def new() -> bool:
        found[:] = [json.loads(m)["headers"]["id"] for name in queue_lists("echo")
                    for m in text.lrange(name, 0, -1)
                    if json.loads(m)["headers"]["id"] not in seen]
        return bool(found)

    wait_until(new, 20, "the job to be queued")
    return found[0]


def _end(state: JobState, text: redis.Redis, job_id: str, final: str) -> None:
    """End the job as a worker (started and finished, by its scripts) or a client would."""
    if final == "cancelled":
        state.cancel(job_id)
        return
    if final == "expired":  # its deadline passed while it waited: the next read expires it
        text.hset(f"iq:job:{job_id}", "expires_at", "1")
        return
    token = state.token_of(job_id) or ""
    batch = batch_text({"id": uuid.uuid4().hex[:12], "jobs": 1, "items": 1})
    assert state.start([job_id], worker="w@h/0/1", batch=batch,
                       tokens=[token]) == [StartDecision.RUN]
    if final == "succeeded":
        done = Final(job_id, Status.SUCCEEDED,
                     results.stored(job_id, outputs=[[0.5, -1.25, 3.0]]), token=token)
    else:
        error = JobError(ErrorCode.INFERENCE_ERROR, "bad input \u00e9")
        done = Final(job_id, Status.FAILED, results.stored(job_id, error=error), error=error,
                     token=token)
    assert state.finish([done], result_ttl_s=600, model_version="v1") == [True]


def _reads(client, headers, monkeypatch, url):
    """GET, `?wait` and HEAD of a job, each made both ways."""
    for read in (lambda: client.get(url, headers=headers),
                 lambda: client.get(f"{url}?wait=5", headers=headers),
                 lambda: client.head(url, headers=headers)):
        fast = _bytes(read())
        assert fast[0] == "200 OK"
        assert fast == _general(monkeypatch, read)
    return _bytes(client.get(url, headers=headers))


@pytest.mark.parametrize("final", ["succeeded", "failed", "cancelled"])
def test_a_waited_answer_is_the_same_bytes_as_the_general_paths(api, monkeypatch, final):
    client, headers, state, text = api
    job = {"model": "echo", "inputs": ["a"]}
    sent = {**headers, "Prefer": "wait=10", "Idempotency-Key": f"k-{final}"}
    seen = set()
    ender = threading.Thread(target=lambda: _end(state, text, _queued(text, seen), final))
    ender.start()
    waited = _bytes(client.post("/v1/jobs", json=job, headers=sent))
    ender.join()
    assert waited[0] == "201 CREATED", waited
    assert json.loads(waited[2])["status"] == final
    if final == "succeeded":
        assert json.loads(waited[2])["result"] == {"outputs": [[0.5, -1.25, 3.0]]}
    # The repeat (its Idempotency-Key) reads the job from its record, headers made the
    # general way: the same bytes.
    assert waited == _general(monkeypatch, lambda: client.post("/v1/jobs", json=job,
                                                               headers=sent))
    url = dict(waited[1])["Location"]
    read = _reads(client, headers, monkeypatch, url)
    assert read[2] == waited[2]  # the body as a read of its record gives it


@pytest.mark.parametrize("final", ["succeeded", "expired"])
def test_a_wait_that_runs_out_is_the_same_bytes_as_the_general_paths(api, monkeypatch, final):
    client, headers, state, text = api
    job = {"model": "echo", "inputs": ["a", "b"], "priority": "high"}
    sent = {**headers, "Prefer": "wait=0.05", "Idempotency-Key": f"out-{final}"}
    timed_out = _bytes(client.post("/v1/jobs", json=job, headers=sent))
    assert timed_out[0] == "202 ACCEPTED" and json.loads(timed_out[2])["status"] == "queued"
    assert dict(timed_out[1])["Preference-Applied"] == "wait=0.05"
    assert timed_out == _general(monkeypatch, lambda: client.post("/v1/jobs", json=job,
                                                                  headers=sent))
    url = dict(timed_out[1])["Location"]
    _end(state, text, url.rsplit("/", 1)[1], final)
    read = _reads(client, headers, monkeypatch, url)
    assert json.loads(read[2])["status"] == final
