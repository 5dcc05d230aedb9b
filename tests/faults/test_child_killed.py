"""A pool child killed mid-batch loses nothing: its jobs are delivered again and succeed."""
from __future__ import annotations

import os
import signal

from scripts.stack import wait_until
from tests.support.records import fields


def test_jobs_of_a_killed_pool_child_complete_after_redelivery(stack):
    jobs = [stack.submit("sleepy", [f"k{i}"]) for i in range(3)]
    first = jobs[0]["id"]
    wait_until(lambda: stack.job(first)["status"] == "running", 30, "the batch to start")
    worker = fields(stack.redis, first).get("worker")
    pid = int(worker.rsplit("/", 1)[1])
    os.kill(pid, signal.SIGKILL)

    done = [stack.finished(j["id"], timeout=120) for j in jobs]
    assert [d["status"] for d in done] == ["succeeded"] * 3
    assert [d["result"]["outputs"] for d in done] == [[2], [2], [2]]
    rerun_by = fields(stack.redis, first).get("worker")
    assert int(rerun_by.rsplit("/", 1)[1]) != pid, "the job must have run again in a new child"
    assert stack.workers["synth"].proc.poll() is None, "the worker itself survives"
