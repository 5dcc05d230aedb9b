"""A worker (re)started while Redis is away (a deploy during a failover, `make run`'s processes
starting together) must be counted live once Redis is back: README, "Readiness tells the
truth".

Today the pool child loads its model, sets its runtime ready and then writes its first
heartbeat (workers/child/runtime.py `ModelRuntime.start`: `self._beat()` before the heartbeat
thread is started). With Redis away that write raises, Celery logs the exception of the
`worker_process_init` handler and the child lives on without a heartbeat thread: it runs every job
it is given, yet /readyz and /v1/models count no instance of it, for as long as the child lives.
"""
from __future__ import annotations

import pytest
import requests

from scripts.stack import launch, start_redis, start_worker, wait_until

pytestmark = pytest.mark.slow

QUICK = {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}


def test_a_worker_started_while_redis_is_away_becomes_ready(tmp_path):
    stack = launch(tmp_path, {"quick": QUICK}, {}, defaults=True, ready_models=[],
                   appendonly=True)
    try:
        stack.redis_svc.stop()
        worker = start_worker("w", stack.env, tmp_path, ["quick"])
        stack.workers["w"] = worker
        # Loaded, and its first heartbeat refused (logged either way it is handled).
        wait_until(lambda: "model quick version" in worker.tail(300)
                   and any(s in worker.tail(300) for s in ("load_models", "heartbeat failed")),
                   60, "the pool child to load its model and fail to announce it")
        stack.redis_svc = start_redis(tmp_path, appendonly=True, like=stack.redis_svc)

        # The worker does serve: a job submitted now succeeds.
        job = stack.submit("quick", ["x"])
        assert stack.finished(job["id"], timeout=60)["status"] == "succeeded"
        # Heartbeats come every 2 s and count for 10 s: 30 s is ample.
        try:
            stack.wait_live(["quick"], 30)
        except TimeoutError:
            checks = requests.get(f"{stack.api}/readyz", timeout=5).json()["checks"]
            pytest.fail(f"the worker runs jobs but /readyz counts none of its instances 30 s "
                        f"after Redis came back: {checks}")
    finally:
        stack.stop()
