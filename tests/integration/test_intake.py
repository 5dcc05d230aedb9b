"""A fetch's task messages are taken in by the worker's consumer together
(workers/broker/intake.py, the batching strategy's `intake`): one Celery would refuse is
refused as Celery's own handler refuses it, and the messages around it run."""
from __future__ import annotations

import base64
import json

import pytest

from config import load_settings
from scripts.stack import launch, start_worker, wait_until
from tasks.celery_app import make_celery
from tasks.names import list_for, queue_lists
from workers.broker.lua import FETCHERS_KEY, INFLIGHT_PREFIX


def _models(runs_log):
    return {"synthetic": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0,
                          "max_batch_size": 8, "max_inputs": 4, "runs_log": str(runs_log)}}


def _edited_among_jobs(stack, tmp_path, edits):
    """A job, then for each (marker, edit) of `edits` a batching task's message (input
    `marker`) edited on its queue list by `edit` and one more job; then a worker starts, so
    that its fetches take them together. The jobs."""
    jobs = [stack.submit("synthetic", ["job-0"])]
    sender = make_celery(load_settings(environ=stack.env))
    sent = list_for("synthetic", 5)
    for i, (marker, edit) in enumerate(edits, start=1):
        sender.send_task("iq.infer.synthetic", kwargs={"inputs": [marker]}, priority=5)
        message = json.loads(stack.redis.lindex(sent, 0))
        edit(message)
        stack.redis.lset(sent, 0, json.dumps(message))
        jobs.append(stack.submit("synthetic", [f"job-{i}"]))
    stack.workers["late"] = start_worker("late", stack.env, tmp_path, ["synthetic"])
    return jobs


def test_an_invalid_task_message_in_a_fetch_is_discarded_and_the_rest_run(tmp_path):
    """Two jobs and, between them, a task message whose `expires` is not a date (Celery's
    `Request` refuses it: InvalidTaskError) wait on the queue when the worker starts, so one
    fetch takes them all: the invalid one is logged and discarded as Celery's consumer does
    (off the queue and off the worker's in-flight record, never run), the jobs run."""
    runs_log = tmp_path / "runs.log"
    stack = launch(tmp_path, _models(runs_log), {}, ready_models=[])
    try:
        def no_date(message):  # its `expires` made one no date parser reads
            message["headers"]["expires"] = "not a date"
        jobs = _edited_among_jobs(stack, tmp_path, [("invalid", no_date)])
        done = [stack.finished(j["id"]) for j in jobs]
        assert [d["status"] for d in done] == ["succeeded"] * 2, done
        log = stack.workers["late"].log
        wait_until(lambda: "Received invalid task message" in log.read_text(errors="replace"),
                   30, "the worker to discard the invalid message")
        text = log.read_text(errors="replace")
        assert "invalid expires value 'not a date'" in text, text[-3000:]
        redis = stack.redis
        assert sum(redis.llen(key) for key in queue_lists("synthetic")) == 0
        fetchers = redis.hkeys(FETCHERS_KEY)
        wait_until(lambda: all(redis.hlen(INFLIGHT_PREFIX + f) == 0 for f in fetchers), 30,
                   "the worker's in-flight record to empty")
        assert fetchers
        assert "invalid" not in runs_log.read_text().split()
    finally:
        stack.stop()


def _no_id(message):
    del message["headers"]["id"]


def _int_body(message):
    message["body"] = base64.b64encode(b"5").decode()


def _headers_list(message):
    message["headers"] = ["iq.infer.synthetic"]


NOT_BASE64 = "%%% not base64 %%%"


def _bad_base64(message):
    message["body"] = NOT_BASE64


def _kwargs_not_dict(message):
    message["body"] = base64.b64encode(b'[[], 7, {}]').decode()


def _nested_headers_text(message):
    message["headers"]["headers"] = "text"


HOSTILE = {"nested_headers_text": _nested_headers_text, "no_id": _no_id,
           "int_body": _int_body, "headers_list": _headers_list, "bad_base64": _bad_base64,
           "kwargs_not_dict": _kwargs_not_dict}
PUT_ASIDE = {"headers_list", "bad_base64"}  # kombu cannot make a message of these


def test_messages_pushed_by_hand_kombu_or_celery_cannot_read_are_put_aside_the_rest_run(
        tmp_path):
    """Batching tasks' messages edited on their queue list, a job between each two (no id, a
    body not a task's, kwargs not a mapping, its headers' headers text, headers not a mapping,
    a body not base64), all waiting when the worker starts, so that its fetches take several
    together: the worker neither stops nor reconnects for ever (its queue stalled); the jobs
    run, the messages do not, the queue and in-flight record empty; each kombu cannot make a
    message of is put aside on iq:malformed, the others discarded as invalid tasks."""
    runs_log = tmp_path / "runs.log"
    stack = launch(tmp_path, _models(runs_log), {}, ready_models=[])
    try:
        jobs = _edited_among_jobs(stack, tmp_path,
                                  [(f"hostile-{kind}", HOSTILE[kind]) for kind in sorted(HOSTILE)])
        done = [stack.finished(j["id"], timeout=60) for j in jobs]
        assert [d["status"] for d in done] == ["succeeded"] * (len(HOSTILE) + 1), done
        redis = stack.redis
        wait_until(lambda: sum(redis.llen(key) for key in queue_lists("synthetic")) == 0, 30,
                   "queues empty")
        fetchers = redis.hkeys(FETCHERS_KEY)
        wait_until(lambda: all(redis.hlen(INFLIGHT_PREFIX + f) == 0 for f in fetchers), 30,
                   "the worker's in-flight record to empty")
        ran = runs_log.read_text().split()
        assert not [kind for kind in HOSTILE if f"hostile-{kind}" in ran], ran
        log = stack.workers["late"].log.read_text(errors="replace")
        assert "Unrecoverable" not in log and "Connection to broker lost" not in log, log[-4000:]
        put_aside = [json.loads(raw) for raw in redis.lrange("iq:malformed", 0, -1)]
        kinds = ["headers_list" if isinstance(m["headers"], list) else
                 "bad_base64" if m["body"] == NOT_BASE64 else m for m in put_aside]
        assert sorted(kinds, key=str) == sorted(PUT_ASIDE), put_aside
    finally:
        stack.stop()


def _expiring(redis, job_id):
    """The job's message on its queue list given an `expires` a day ahead (Celery's to read:
    it never lapses here)."""
    for key in queue_lists("synthetic"):
        for i, raw in enumerate(redis.lrange(key, 0, -1)):
            message = json.loads(raw)
            if message["headers"]["id"] == job_id:
                message["headers"]["expires"] = "2999-01-01T00:00:00+00:00"
                redis.lset(key, i, json.dumps(message))
                return
    raise AssertionError(f"job {job_id}'s message is on no queue list")


def test_a_job_that_runs_and_succeeds_builds_no_celery_request(tmp_path):
    """Jobs fetched, batched, run and succeeded are held as light jobs (workers/batching/
    job.py): the worker builds no Celery Request for any of them, by its own count in
    `celery inspect stats` (`iq.requests_built`); one whose message asks Celery for more (an
    `expires`) gets its Request at intake, and runs all the same."""
    stack = launch(tmp_path, _models(tmp_path / "runs.log"), {}, ready_models=[])
    try:
        jobs = [stack.submit("synthetic", [f"job-{i}"]) for i in range(12)]
        _expiring(stack.redis, jobs[5]["id"])
        stack.workers["late"] = start_worker("late", stack.env, tmp_path, ["synthetic"])
        done = [stack.finished(j["id"], timeout=60) for j in jobs]
        assert [d["status"] for d in done] == ["succeeded"] * 12, done
        control = make_celery(load_settings(environ=stack.env)).control
        stats: dict = {}
        wait_until(lambda: stats.update(control.inspect(timeout=2).stats() or {}) or stats,
                   30, "the worker's stats")
        (node, answer), = stats.items()
        assert answer["iq"] == {"requests_built": 1}, (node, answer["iq"])
    finally:
        stack.stop()
