"""Whole processes die: the worker (SIGKILL) and Redis (restart). Nothing accepted is lost."""
from __future__ import annotations

import os
import signal
import time

import requests

from tests.faults.conftest import SERVED, fault_stack
from tests.support.services import start_redis, start_worker, wait_until


def test_a_killed_worker_loses_nothing_once_restarted(tmp_path):
    # The visibility timeout is how long Redis keeps an unacknowledged job from being
    # delivered again; it is short here so that the test need not wait an hour.
    stack = fault_stack(tmp_path, env_extra={"IQ_VISIBILITY_TIMEOUT_S": "4"})
    try:
        jobs = [stack.submit("sleepy", [f"w{i}"]) for i in range(6)]
        wait_until(lambda: stack.job(jobs[0]["id"])["status"] == "running", 30, "a batch")
        os.kill(stack.workers["faults"].proc.pid, signal.SIGKILL)
        stack.workers["faults"].proc.wait(10)
        stack.workers["faults"] = start_worker("faults", stack.env, tmp_path, SERVED)
        done = [stack.finished(j["id"], timeout=120) for j in jobs]
        assert [d["status"] for d in done] == ["succeeded"] * 6
    finally:
        stack.stop()


def test_redis_restart_loses_no_accepted_job_and_everyone_reconnects(tmp_path):
    stack = fault_stack(tmp_path, appendonly=True,
                        env_extra={"IQ_VISIBILITY_TIMEOUT_S": "4"})
    try:
        port, password = stack.redis_svc.extra["port"], stack.redis_svc.extra["password"]
        jobs = [stack.submit("sleepy", [f"r{i}"]) for i in range(6)]
        wait_until(lambda: stack.job(jobs[0]["id"])["status"] == "running", 30, "a batch")
        stack.redis_svc.stop()  # SIGTERM: Redis flushes its append-only file and exits

        started = time.monotonic()
        r = requests.post(f"{stack.api}/v1/jobs", json={"model": "quick", "inputs": ["x"]},
                          timeout=30)
        assert r.status_code == 503 and time.monotonic() - started < 10
        assert int(r.headers["Retry-After"]) > 0
        assert r.json()["error"]["code"] == "unavailable"

        stack.redis_svc = start_redis(tmp_path, port=port, appendonly=True, password=password)
        # Neither the API nor the worker is restarted: both reconnect by themselves.
        stack.wait_live(SERVED, 60)
        done = [stack.finished(j["id"], timeout=120) for j in jobs]
        assert [d["status"] for d in done] == ["succeeded"] * 6
        after = stack.finished(stack.submit("quick", ["again"])["id"], timeout=60)
        assert after["status"] == "succeeded"
    finally:
        stack.stop()
