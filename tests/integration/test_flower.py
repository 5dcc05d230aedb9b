"""Flower, behind basic auth, shows each batched job as its own task in its true state; a task
it sends by hand with a job's id (its send-task) is not the job's own, and is refused."""
from __future__ import annotations

import json
import uuid

import pytest
import requests

from config import load_settings
from scripts.stack import launch, start_flower, start_worker, wait_until
from tasks.celery_app import make_celery

AUTH = ("ops", "s3cret-test-password")


@pytest.fixture(scope="module")
def flower(stack):
    svc = start_flower(stack.env, stack.workdir, ":".join(AUTH))
    yield svc.extra["url"]
    svc.stop()


def test_flower_requires_auth(flower):
    assert requests.get(f"{flower}/api/tasks", timeout=5).status_code == 401
    assert requests.get(f"{flower}/api/tasks", auth=("ops", "wrong"), timeout=5).status_code == 401


def test_flower_lists_batched_jobs_as_success(stack, flower):
    # Wait until Flower sees the workers, so it is listening for their task events.
    wait_until(lambda: len(requests.get(f"{flower}/api/workers", auth=AUTH, timeout=5).json())
               >= 2, 30, "Flower to see both workers")
    jobs = [stack.submit("synthetic", [f"flower-{i}"]) for i in range(5)]
    done = [stack.finished(j["id"]) for j in jobs]
    assert all(d["status"] == "succeeded" for d in done)
    assert len({d["batch"]["id"] for d in done}) < len(jobs)  # they really were batched

    def states():
        tasks = requests.get(f"{flower}/api/tasks", auth=AUTH, timeout=5).json()
        return {j["id"]: tasks.get(j["id"], {}).get("state") for j in jobs}

    wait_until(lambda: set(states().values()) == {"SUCCESS"}, 30, "Flower to show SUCCESS")
    tasks = requests.get(f"{flower}/api/tasks", auth=AUTH, timeout=5).json()
    for job in jobs:
        task = tasks[job["id"]]
        assert task["name"] == "iq.infer.synthetic"
        assert task["runtime"] is not None and task["runtime"] > 0
        assert task["received"] and task["started"] and task["succeeded"]
        # Private by default: the job's summary, not its inputs.
        assert "flower-" not in task["kwargs"] and "'inputs': 1" in task["kwargs"]
        assert f"'trace_id': '{job['trace_id']}'" in task["kwargs"]


def test_no_inspector_shows_the_inputs_of_a_running_or_waiting_job(stack, flower):
    """Flower's worker page and `/api/workers?refresh=1`, `inspect active`, `reserved` and
    `query_task` show a job's summary, as its task events do, never its inputs."""
    token = uuid.uuid4().hex
    jobs = [stack.submit("sleepy", [f"private input {token} {i}"]) for i in range(9)]
    ids = [j["id"] for j in jobs]
    # An inspect waits its whole timeout for replies: short, so that both see one moment.
    inspect = make_celery(load_settings(environ=stack.env)).control.inspect(timeout=1)

    def running_and_waiting() -> tuple[dict, dict] | None:
        active, reserved = inspect.active() or {}, inspect.reserved() or {}
        running = [t for tasks in active.values() for t in tasks if t["id"] in ids]
        waiting = [t for tasks in reserved.values() for t in tasks if t["id"] in ids]
        return (active, reserved) if running and waiting else None

    try:
        active, reserved = wait_until(running_and_waiting, 30, "a job running, one waiting")
        queried = inspect.query_task(*ids) or {}
        workers = requests.get(f"{flower}/api/workers", params={"refresh": 1}, auth=AUTH,
                               timeout=30).json()
        (name,) = [n for n in workers if n.startswith("synth@")]
        page = requests.get(f"{flower}/worker/{name}", auth=AUTH, timeout=30).text
    finally:
        for job_id in ids:
            stack.finished(job_id)
    seen = [task for tasks in [*active.values(), *reserved.values()] for task in tasks
            if task["id"] in ids]
    assert all("'inputs': 1" in task["kwargs"] for task in seen), seen  # the summary
    assert {i for answer in queried.values() for i in answer} & set(ids)
    shown = [json.dumps(x) for x in (active, reserved, queried, workers)] + [page]
    assert any(job_id in page for job_id in ids)  # Flower's page lists them
    for text in shown:
        assert token not in text, text[:2000]


def test_a_task_sent_through_flower_with_a_queued_jobs_id_does_not_become_its_result(stack,
                                                                                     flower):
    """Flower's send-task (an operator's login) queues an inference with a waiting job's id,
    its own inputs and the highest priority: it is not the job's own message (no token), so
    it neither runs as the job nor finishes it; the job runs once, on its own input."""
    blocker = stack.submit("sleepy", ["keeps the worker busy"])
    wait_until(lambda: stack.job(blocker["id"])["status"] == "running", 30, "the blocker")
    victim = stack.submit("sleepy", ["v"])
    sent = requests.post(f"{flower}/api/task/send-task/iq.infer.sleepy", auth=AUTH, timeout=30,
                         json={"kwargs": {"inputs": ["forged by a flower user"]},
                               "task_id": victim["id"], "priority": 0})
    assert sent.status_code == 200, sent.text
    done = stack.finished(victim["id"])
    assert done["status"] == "succeeded" and done["result"]["outputs"] == [1], done
    assert stack.job(victim["id"])  # read again: nothing changed it since
    wait_until(lambda: f"a message for job {victim['id']} that is not the job's own" in
               stack.workers["synth"].log.read_text(errors="replace"), 30,
               "the worker to drop the forged message")
    stack.finished(blocker["id"])


def test_a_task_sent_by_hand_ahead_of_the_jobs_own_message_is_dropped_and_the_job_runs(tmp_path):
    """The same forgery served first: sent at the highest priority while the job's own message
    still waits, it reaches the worker before it (here both wait, behind a high-priority job,
    when the worker starts). The job's own message must not be dropped as a copy of the forged
    one (the job would then wait a lease for the reconciler to queue it again): the forged one
    leaves the buffer as not the job's own, never reaching the model, and the job runs once,
    on its own input."""
    runs_log = tmp_path / "runs.log"
    models = {"sleepy": {"kind": "synthetic", "base_ms": 500, "per_item_ms": 0,
                         "max_batch_size": 4, "max_inputs": 4, "runs_log": str(runs_log)}}
    stack = launch(tmp_path, models, {}, ready_models=[])
    try:
        blocker = stack.submit("sleepy", ["blocker"], priority="high")
        victim = stack.submit("sleepy", ["v"])
        # What Flower's send-task does with its app: a task message of the job's id, no token.
        forger = make_celery(load_settings(environ=stack.env))
        forger.send_task("iq.infer.sleepy", kwargs={"inputs": ["forged by hand"]},
                         task_id=victim["id"], priority=0)
        stack.workers["late"] = start_worker("late", stack.env, tmp_path, ["sleepy"])
        done = stack.finished(victim["id"])
        assert done["status"] == "succeeded" and done["result"]["outputs"] == [1], done
        assert stack.finished(blocker["id"])["status"] == "succeeded"
        assert runs_log.read_text().splitlines().count("v") == 1
        assert "forged by hand" not in runs_log.read_text()
        log = stack.workers["late"].log.read_text(errors="replace")
        assert (f"workers.batching.dispatcher [trace_id=-] a message for job {victim['id']} "
                "that is not the job's own") in log, log[-3000:]
        assert "delivered again" not in log and "queued again from its record" not in log, \
            log[-3000:]
    finally:
        stack.stop()
