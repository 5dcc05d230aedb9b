"""Flower, behind basic auth, shows each batched job as its own task in its true state."""
from __future__ import annotations

import pytest
import requests

from scripts.stack import start_flower, wait_until

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
