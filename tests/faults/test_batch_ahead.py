"""A batch handed ahead (`batches_ahead`, default 1: workers/broker/pool.py HeldBatches) to the
one child, on the defaults, under load: the child killed mid-batch while its next batch waits in
its pipe loses nothing; the jobs of the batch it ran run again, those of the batch it held ahead
(never taken up) run once, on its replacement."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from scripts.stack import launch, wait_until
from tests.support.outcomes import settle
from tests.support.records import fields_of

STANDIN = {"kind": "synthetic", "base_ms": 4000, "per_item_ms": 0, "prepare_ms": 1,
           "output_floats": 8, "max_batch_size": 4, "max_inputs": 4}


def test_a_killed_child_reruns_the_batch_it_ran_and_once_the_batch_held_ahead(tmp_path):
    stack = launch(tmp_path, {"gpu": STANDIN}, {"one": ["gpu"]}, concurrency=1)
    try:
        warm = stack.submit("gpu", ["warm"])["id"]  # the model timed: its usual 4 s
        assert settle(stack, [warm])[warm].get("status") == "succeeded"
        with ThreadPoolExecutor(8) as pool:  # under load: 16 jobs posted at once
            ids = [job["id"] for job in pool.map(lambda i: stack.submit("gpu", [f"j{i}"]),
                                                 range(16))]

        def running() -> set[str]:
            return {j for j, r in fields_of(stack.redis, ids).items()
                    if r.get("status") == "running" and r.get("worker")}

        # A full batch runs; the next, full too, is handed ahead a quarter of its time before
        # its end (dispatcher.py `_ahead_due`): past that, it waits in the child's pipe.
        wait_until(lambda: len(running()) == 4, 90, "a full batch running")
        killed = running()
        records = fields_of(stack.redis, sorted(killed))
        (worker,) = {r["worker"] for r in records.values()}
        started = max(int(r["started_at"]) for r in records.values()) / 1000
        wait_until(lambda: time.time() >= started + 3.3, 10, "the batch near its end")
        os.kill(int(worker.rsplit("/", 1)[1]), signal.SIGKILL)

        records = settle(stack, ids)
        assert {r.get("status") for r in records.values()} == {"succeeded"}, records
        runs = {j: r.get("runs") for j, r in records.items()}
        # The batch the child ran, again; every other job once: the batch it held ahead went
        # back to the pool and ran on the replacement (a job started between the reading above
        # and the kill would show as a second run outside `killed`: the 4 s device call
        # leaves no such window).
        assert {j for j, n in runs.items() if n == "2"} == killed, runs
        assert all(runs[j] == "1" for j in set(ids) - killed), runs
        assert stack.workers["one"].proc.poll() is None, "the worker itself survives"
    finally:
        stack.stop()
