"""A reload that shifts queues along (alpha takes beta's queue, beta a new one) with workers
pinned to queues (-Q, IQ_WORKER_QUEUES, as one model per worker is run), on the default
settings, under load, runs counted per job: `shift`, alpha takes beta's queue and beta a new
one (its worker started first, on the next file: a worker refuses a queue its file lacks, a
reload a queue no worker consumes); `swap`, the two exchange queues. beta's old queue is not
moved from (a model still has it), so beta's backlog there meets a worker now on alpha's
file; every accepted job must still end succeeded having run once, none left queued."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from scripts.stack import ROOT, launch, start_worker, wait_until
from tasks.keys import consuming_key
from tests.faults.test_reload_queues import waiting
from tests.support.load import Load
from tests.support.outcomes import assert_each_succeeded_once, settle

FAST = {"kind": "synthetic", "base_ms": 20, "per_item_ms": 1, "max_batch_size": 8}
SLOW = {"kind": "synthetic", "base_ms": 150, "per_item_ms": 1, "max_batch_size": 2}


# In `make test-long` (~50 and ~65 s here); `make test` keeps a queue renamed under load
# (test_reload_queues.py).
pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.mark.parametrize("change", ["shift", "swap"])
def test_queues_shifted_along_under_load_strand_no_job(tmp_path, change):
    stack = launch(tmp_path, {"alpha": FAST, "beta": SLOW},
                   {"qa": ["alpha"], "qb": ["beta"]}, defaults=True)
    loads = []
    new = tmp_path / "next.yaml"
    beta_queue = "beta-q2" if change == "shift" else "alpha"
    new.write_text(yaml.safe_dump({"models": {"alpha": {**FAST, "queue": "beta"},
                                              "beta": {**SLOW, "queue": beta_queue}}}))
    try:
        # The worker for the new queue, started first on the next file (a worker refuses a
        # queue its file lacks; a reload refuses a queue no worker consumes).
        if change == "shift":
            stack.workers["qc"] = start_worker("qc", dict(stack.env, IQ_MODELS_FILE=str(new)),
                                               tmp_path, ["beta-q2"])
            wait_until(lambda: stack.redis.zcard(consuming_key("beta-q2")) >= 1, 180,
                       "the beta-q2 worker to consume")
        loads = [Load(stack.api, "beta", "shift-b", clients=3, pause_s=0.05).start(),
                 Load(stack.api, "alpha", "shift-a", clients=1, pause_s=0.1).start()]
        wait_until(lambda: waiting(stack, "beta") >= 20, 90, "a backlog on beta's queue")
        done = subprocess.run([sys.executable, "-m", "scripts.reload", str(new), "--timeout",
                               "240"], cwd=ROOT, env=stack.env, capture_output=True, text=True,
                              timeout=360)
        status, out = done.returncode, done.stdout + done.stderr
        print(out)
        assert status == 0, out
        after = len(loads[0].accepted)
        wait_until(lambda: len(loads[0].accepted) >= after + 20, 120, "jobs after the reload")
        for load in loads:
            load.stop()
        jobs = [j for load in loads for j in load.accepted.values()]
        records = settle(stack, jobs, timeout=240)
        print(f"\nqueues shifted: {len(jobs)} accepted, "
              f"{sum(r.get('status') == 'succeeded' for r in records.values())} succeeded, "
              f"{sum(r.get('status') == 'queued' for r in records.values())} queued, "
              f"errors {sorted({r.get('error', '')[:60] for r in records.values()})[:4]}")
        print("\n".join(l for l in stack.logs().splitlines()
                        if "unavailable" in l or "not loaded" in l or "moved" in l)[-3000:])
        assert_each_succeeded_once(records)
        for queue in ("alpha", "beta", "beta-q2"):
            assert waiting(stack, queue) == 0, queue
    except BaseException:
        print(stack.logs()[-20000:])
        raise
    finally:
        for load in loads:
            load.stop()
        stack.stop()
