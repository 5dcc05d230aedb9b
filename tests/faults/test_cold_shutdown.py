"""A cold shutdown (SIGQUIT) of a worker mid-batch: its running jobs are no fault of their own,
so they come back and run on the next worker, as after a warm stop that kills its child. Before,
the pool's `Terminated` failed them for good (`worker_error: Terminated: 9`)."""
from __future__ import annotations

import signal

from scripts.processes import wait_until
from scripts.stack import launch, start_worker
from tests.support.records import fields_of

MODELS = {"slow": {"kind": "synthetic", "base_ms": 4000, "per_item_ms": 0, "max_batch_size": 4}}
FINAL = ("succeeded", "failed", "cancelled", "expired")


def test_a_cold_shutdown_mid_batch_puts_its_running_jobs_back(tmp_path):
    stack = launch(tmp_path, MODELS, {"w": ["slow"]}, defaults=True)
    try:
        jobs = [stack.submit("slow", [f"a{i}"])["id"] for i in range(8)]
        wait_until(lambda: any(r.get("status") == "running"
                               for r in fields_of(stack.redis, jobs).values()), 60, "a batch")
        # Batches take 4 s: the batch seen running is the one the signal stops.
        running = {j for j, r in fields_of(stack.redis, jobs).items()
                   if r.get("status") == "running"}
        svc = stack.workers["w"]
        svc.proc.send_signal(signal.SIGQUIT)
        svc.proc.wait(timeout=60)
        stack.workers["w"] = start_worker("w2", stack.env, tmp_path, ["slow"], 1)
        wait_until(lambda: all(r.get("status") in FINAL
                               for r in fields_of(stack.redis, jobs).values()), 180, "all final")
        records = fields_of(stack.redis, jobs)
        failed = {j: r.get("error") for j, r in records.items() if r.get("status") != "succeeded"}
        assert not failed, failed
        # Each job ran once, but those of the stopped batch, which ran again: twice.
        assert {j: int(r["runs"]) for j, r in records.items()} == \
            {j: 2 if j in running else 1 for j in jobs}
    finally:
        stack.stop()
