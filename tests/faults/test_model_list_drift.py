"""A worker told to consume a queue that no model of its own models file uses (a stale models
file on one host, a wrong IQ_WORKER_QUEUES) must not swallow that queue's jobs: Celery would
take each as an unregistered task and drop it. It refuses to start instead, naming the queue,
and the job waits for a worker that has the model (README, Reliability: "every accepted job
reaches a final status, nothing is lost")."""
from __future__ import annotations

import pytest
import yaml

from scripts.stack import launch, start_worker, wait_until
from tasks.names import queue_lists

pytestmark = pytest.mark.slow

QUICK = {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}


def test_a_worker_with_a_stale_model_list_refuses_to_start_and_loses_no_job(tmp_path):
    stack = launch(tmp_path, {"quick": QUICK, "other": QUICK}, {}, defaults=True,
                   ready_models=[])
    try:
        job = stack.submit("other", ["x"])
        stale = tmp_path / "stale"
        stale.mkdir()
        (stale / "models.yaml").write_text(yaml.safe_dump({"models": {"quick": QUICK}}))
        stale_worker = start_worker("stale", dict(stack.env,
                                                  IQ_MODELS_FILE=str(stale / "models.yaml")),
                                    stale, ["quick", "other"])
        stack.workers["stale"] = stale_worker
        wait_until(lambda: stale_worker.proc.poll() is not None, 120, "the stale worker to stop")
        assert stale_worker.proc.returncode != 0
        assert "consumes other, which no model in its models file" in stale_worker.tail(300)
        # The job is still on its queue, for a worker that has the model.
        assert sum(stack.redis.llen(name) for name in queue_lists("other")) == 1
        stack.workers["good"] = start_worker("good", stack.env, tmp_path, ["quick", "other"])
        assert stack.finished(job["id"], timeout=120)["status"] == "succeeded"
    finally:
        stack.stop()
