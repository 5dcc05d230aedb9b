"""Leases on the default settings: however long a job waits in a live worker's buffer or runs
in its batch, longer than the visibility timeout (30 s) included, no other worker gets it."""
from __future__ import annotations

import collections

import pytest

from scripts.stack import launch, start_worker, wait_until
from tests.faults.test_recovery import held_by_workers
from tests.support.records import fields

pytestmark = pytest.mark.slow


def test_a_live_workers_jobs_are_never_handed_out_again(tmp_path):
    log = tmp_path / "runs.log"
    # One child: while the long batch runs (40 s), the quick job waits in the buffer as long.
    # Both outlast the visibility timeout plus a sweep (35 s).
    models = {"long": {"kind": "synthetic", "base_ms": 40_000, "per_item_ms": 0,
                       "runs_log": str(log)},
              "quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0,
                        "runs_log": str(log)}}
    stack = launch(tmp_path, models, {"a": ["long", "quick"]}, defaults=True)
    try:
        long_job = stack.submit("long", ["long-job"])
        wait_until(lambda: stack.job(long_job["id"])["status"] == "running", 30, "a batch")
        quick_job = stack.submit("quick", ["quick-job"])
        wait_until(lambda: held_by_workers(stack) == 2, 30, "a to hold both jobs")
        # Another worker, idle and consuming the same queues: any message whose lease ran
        # out would be swept back and run here.
        stack.workers["b"] = start_worker("b", stack.env, tmp_path, ["long", "quick"])
        done = [stack.finished(j["id"], timeout=120) for j in (long_job, quick_job)]
        assert [d["status"] for d in done] == ["succeeded", "succeeded"]
        assert all(fields(stack.redis, d['id']).get("worker").startswith("a@")
                   for d in done)
        runs = collections.Counter(log.read_text().splitlines())
        assert (runs["long-job"], runs["quick-job"]) == (1, 1)
    finally:
        stack.stop()
