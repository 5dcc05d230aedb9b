"""A fetch's task messages are taken in by the worker's consumer together
(workers/broker/intake.py, the batching strategy's `intake`): one Celery would refuse is
refused as Celery's own handler refuses it, and the messages around it run."""
from __future__ import annotations

import json

from config import load_settings
from scripts.stack import launch, start_worker, wait_until
from tasks.celery_app import make_celery
from tasks.names import list_for, queue_lists
from workers.broker.lua import FETCHERS_KEY, INFLIGHT_PREFIX


def test_an_invalid_task_message_in_a_fetch_is_discarded_and_the_rest_run(tmp_path):
    """Three jobs and, between them, a task message whose `expires` is not a date (Celery's
    `Request` refuses it: InvalidTaskError) wait on the queue when the worker starts, so one
    fetch takes them all: the invalid one is logged and discarded as Celery's consumer does
    (off the queue and off the worker's in-flight record, never run), the jobs run."""
    runs_log = tmp_path / "runs.log"
    models = {"synthetic": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0,
                            "max_batch_size": 8, "max_inputs": 4, "runs_log": str(runs_log)}}
    stack = launch(tmp_path, models, {}, ready_models=[])
    try:
        first = [stack.submit("synthetic", [f"job-{i}"]) for i in range(2)]
        sender = make_celery(load_settings(environ=stack.env))
        sender.send_task("iq.infer.synthetic", kwargs={"inputs": ["invalid"]}, priority=5)
        sent = list_for("synthetic", 5)  # its `expires` made one no date parser reads
        message = json.loads(stack.redis.lindex(sent, 0))
        message["headers"]["expires"] = "not a date"
        stack.redis.lset(sent, 0, json.dumps(message))
        last = stack.submit("synthetic", ["job-2"])
        stack.workers["late"] = start_worker("late", stack.env, tmp_path, ["synthetic"])
        done = [stack.finished(j["id"]) for j in [*first, last]]
        assert [d["status"] for d in done] == ["succeeded"] * 3, done
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
