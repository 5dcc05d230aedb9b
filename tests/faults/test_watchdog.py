"""A worker whose event loop hangs is seen as not ready, and restarts itself (the watchdog,
workers/batching/watchdog.py), on the default settings: nothing accepted meanwhile is lost.

The hang is a real one: a proxy between the worker and Redis sends the worker's pub/sub
connection half a message and nothing more, and the worker's event loop reads that socket
with no timeout (redis-py blocks until the message is whole)."""
from __future__ import annotations

import os
import time

import pytest
import requests

from tests.support.redis_proxy import RedisProxy
from scripts.stack import launch, start_worker, wait_until

pytestmark = pytest.mark.slow


def ready(stack) -> bool:
    r = requests.get(f"{stack.api}/readyz", timeout=5)
    return r.status_code == 200 and r.json()["checks"]["model:quick"]["instances"] == 1


def test_a_worker_whose_loop_hangs_is_not_ready_and_restarts_itself(tmp_path):
    models = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}
    stack = launch(tmp_path, models, {}, ready_models=[], defaults=True)
    proxy = RedisProxy(stack.redis_svc.extra["port"])
    try:
        env = dict(stack.env, REDIS_URL=proxy.url(stack.redis_svc.extra["app_password"]))
        worker = stack.workers["w"] = start_worker("w", env, tmp_path, ["quick"])
        wait_until(lambda: ready(stack), 120, "the worker to be ready")
        assert stack.finished(stack.submit("quick", ["before"])["id"])["status"] == "succeeded"

        assert proxy.cut_subscribers() >= 1
        hung_at = time.monotonic()
        # Readiness tells the truth: the worker's process and its child are alive, but its
        # loop no longer turns, so it is not counted.
        wait_until(lambda: not ready(stack), 30, "/readyz to stop counting the hung worker")
        jobs = [stack.submit("quick", [f"during-{i}"]) for i in range(5)]
        wait_until(lambda: "watchdog: this worker stopped working" in worker.log.read_text(),
                   120, "the watchdog to restart the worker")
        done = [stack.finished(j["id"], timeout=120) for j in jobs]
        assert {d["status"] for d in done} == {"succeeded"}
        assert time.monotonic() - hung_at < 60 + 60  # the watchdog's 60 s, then a restart
        # The same process, started again in place (exec), and ready again.
        assert worker.proc.poll() is None
        assert os.path.exists(f"/proc/{worker.proc.pid}")
        wait_until(lambda: ready(stack), 60, "the restarted worker to be ready")
    finally:
        proxy.close()
        stack.stop()
