"""A job's task message is built from a template made once a process (tasks/messages.py
`_Template`), byte for byte what Celery's `as_task_v2` builds (`_by_celery`): a rolling upgrade
puts workers of the release before beside this release's API, and each reads the other's
messages. The API in-process with Flask's test client, against a real Redis and no worker."""
from __future__ import annotations

import hashlib
import sys

import pytest
import redis
import yaml

from app import create_app
from app import store as app_store
from tasks import messages
from tests.support.models import MINILM_PACKAGE

MODELS = {"echo": {"kind": "synthetic", "max_inputs": 4},
          "sorter": {"kind": "classification", "package": MINILM_PACKAGE,
                     "labels": ["sports", "cooking"], "max_inputs": 4}}
KEY = "s3cret-key-of-alice"


def _app(server, tmp_path, **settings):
    redis.Redis.from_url(server.extra["admin_url"]).flushdb()
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"models": MODELS}))
    return create_app({"redis_url": server.extra["url"], "models_file": str(models),
                       "webhook_secret": "w" * 32, "webhook_allow": "127.0.0.1", **settings})


@pytest.fixture
def built(monkeypatch):
    """Each task message the API builds, beside the one Celery's `as_task_v2` builds from the
    same arguments (`_by_celery`), with its delivery tag (random) made the same."""
    pairs: list[tuple[bytes, bytes]] = []

    def both(app, name, task_id, kwargs, *, queue, priority, headers=None, summary=None,
             retries=0):
        message = messages.task_message(app, name, task_id, kwargs, queue=queue,
                                        priority=priority, headers=headers, summary=summary,
                                        retries=retries)
        celerys, tag = messages._by_celery(app, name, task_id, kwargs, queue, priority,
                                           headers, summary, retries)
        mine = messages.orjson.loads(message.payload)["properties"]["delivery_tag"].encode()
        pairs.append((message.payload.replace(mine, tag.encode()), celerys))
        return message

    monkeypatch.setattr(app_store, "task_message", both)
    return pairs


SUBMITS = [
    ({"model": "echo", "inputs": ["a"]}, {}),
    ({"model": "echo", "inputs": ["a", "b"], "priority": "high", "timeout_s": 30}, {}),
    ({"model": "echo", "inputs": ["é ü \u2028 \"quoted\" \\ back"], "priority": "low"}, {}),
    ({"model": "echo", "inputs": ["a"], "encoding_format": "float",
      "webhook": {"url": "http://127.0.0.1:9/hook"}}, {}),
    ({"model": "echo", "inputs": ["a"],
      "webhook": {"url": "https://127.0.0.1/h?x=1", "events": ["failed"]}}, {}),
    ({"model": "sorter", "inputs": ["a match"], "options": {"labels": ["x", "y"]}}, {}),
    ({"model": "echo", "inputs": ["a"]}, {"Idempotency-Key": "order-1"}),
    ({"model": "echo", "inputs": ["a"]}, {"X-Request-ID": "my-trace-\u00e9"}),
    ({"model": "echo", "inputs": ["a"]}, {"Prefer": "wait=0.01"}),
]


@pytest.mark.parametrize("full_args", [False, True], ids=["summary", "events_full_args"])
def test_a_submits_task_message_is_byte_for_byte_what_celery_builds(redis_server, tmp_path,
                                                                    built, full_args):
    app = _app(redis_server, tmp_path, events_full_args=full_args)
    api = app.test_client()
    try:
        for body, headers in SUBMITS:
            r = api.post("/v1/jobs", json=body, headers=headers)
            assert r.status_code in (201, 202), r.get_json()
        # a retry of a cancelled job (retry_of), as its own submit
        url = api.post("/v1/jobs", json={"model": "echo", "inputs": ["z"]}).get_json()["url"]
        assert api.post(f"{url}/cancel").status_code == 200
        assert api.post(f"{url}/retry").status_code == 202
    finally:
        app.extensions["iq.store"].waiter.close()
    assert len(built) == len(SUBMITS) + 2
    for mine, celerys in built:
        assert mine == celerys


def test_a_keys_submits_task_message_is_what_celery_builds(redis_server, tmp_path, built):
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [
        {"name": "alice", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}))
    app = _app(redis_server, tmp_path, api_keys_file=str(keys))
    try:
        r = app.test_client().post("/v1/jobs", json={"model": "echo", "inputs": ["a"]},
                                   headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 202
    finally:
        app.extensions["iq.store"].waiter.close()
    [(mine, celerys)] = built
    assert mine == celerys


def test_messages_of_other_tasks_are_what_celery_builds():
    """A webhook delivery's (a pool child's, the deliverer's retry: `retries`) too."""
    from celery import Celery

    app = Celery("probe")
    for args in [("iq.webhook.deliver", "d-1", {"job_id": "j", "event": "succeeded",
                                                "trace_id": None}, "webhooks", 5, None, None, 0),
                 ("iq.webhook.deliver", "d-2", {"job_id": "j", "event": "failed",
                                                "trace_id": "t"}, "webhooks", 5, None, None, 3),
                 ("iq.infer.x", "t-1", {"inputs": [[1.5, 2]], "options": {"top_k": 2}}, "x", 9,
                  {"trace_id": "t", "job_token": "k", "traceparent": "00-ab-cd-01"},
                  {"model": "x"}, 0)]:
        message = messages.task_message(app, args[0], args[1], args[2], queue=args[3],
                                        priority=args[4], headers=args[5], summary=args[6],
                                        retries=args[7])
        celerys, tag = messages._by_celery(app, *args)
        mine = messages.orjson.loads(message.payload)["properties"]["delivery_tag"].encode()
        assert message.payload.replace(mine, tag.encode()) == celerys


def test_celerys_as_task_v2_is_called_once_a_process_not_once_a_message():
    """The template is made at an app's first message (and checked there against Celery's
    own build of a probe); its later messages fill it in."""
    from celery import Celery

    app = Celery("probe")
    messages.task_message(app, "iq.infer.x", "t-0", {"inputs": ["a"]}, queue="x", priority=5)
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_name == "as_task_v2":
            calls += 1

    sys.setprofile(profile)
    try:
        for i in range(10):
            messages.task_message(app, "iq.infer.x", f"t-{i + 1}", {"inputs": ["a"]},
                                  queue="x", priority=5, summary={"model": "x"})
    finally:
        sys.setprofile(None)
    assert calls == 0, calls


def test_a_celery_that_builds_otherwise_builds_each_message_itself(monkeypatch):
    """Should Celery's `as_task_v2` build what the template cannot (a header of its own for
    each message), the template is refused at its probe and Celery builds every message."""
    from celery import Celery

    app = Celery("probe")
    real = app.amqp.as_task_v2
    seen = iter(range(1_000))

    def stamped(*args, **kwargs):
        message = real(*args, **kwargs)
        message.headers["stamp"] = next(seen)
        return message

    monkeypatch.setattr(app.amqp, "as_task_v2", stamped)
    payloads = [messages.orjson.loads(messages.task_message(
        app, "iq.infer.x", f"t-{i}", {"inputs": ["a"]}, queue="x", priority=5).payload)
        for i in range(3)]
    stamps = [p["headers"]["stamp"] for p in payloads]
    assert len(set(stamps)) == 3
