"""A reload that renames a model's `queue:` while REDIS_URL's Redis is frozen (SIGSTOP) for
longer than heartbeat_ttl_s, then SIGCONT, on the default settings, under load, runs counted
per job. After the freeze every consuming entry (tasks/presence.py) has lapsed: the first
worker tick to run the queue move (tasks/queuemoves.py) reads the old queue as consumed by no
one, although a worker may still consume it. `pinned`: a second worker started with -Q on the
old queue keeps consuming it throughout. Whatever moves, every accepted job must run once and
none may stay queued on either queue."""
from __future__ import annotations

import os
import signal
import time

import orjson
import pytest

from scripts.stack import launch, start_worker, wait_until
from tasks.keys import RELOAD_STATUS_KEY, consuming_key
from tests.faults.test_reload_queues import ALPHA, BETA, MODELS, reload_process, waiting
from tests.support.load import Load
from tests.support.outcomes import assert_each_succeeded_once, settle

# In `make test-long` (~45 and ~55 s here); `make test` keeps a Redis freeze in a reload
# (test_reload_redis_freeze.py).
pytestmark = [pytest.mark.slow, pytest.mark.long]

FREEZE_S = 12.0  # past heartbeat_ttl_s (10 s by default): every consuming entry lapses


def reloading(stack) -> bool:
    states = [orjson.loads(raw) for name, raw in stack.redis.hgetall(RELOAD_STATUS_KEY).items()
              if (name.decode() if isinstance(name, bytes) else name).startswith("worker:all")]
    return any(s.get("state") == "reloading" for s in states)


@pytest.mark.parametrize("pinned", [False, True])
def test_a_queue_renamed_across_a_redis_freeze_strands_no_job_nor_runs_one_twice(tmp_path,
                                                                                 pinned):
    stack = launch(tmp_path, MODELS, {"all": None}, defaults=True)
    load, proc = None, None
    try:
        if pinned:
            stack.workers["old"] = start_worker("old", stack.env, tmp_path, ["alpha"])
            wait_until(lambda: stack.redis.zcard(consuming_key("alpha")) >= 2, 120,
                       "the -Q alpha worker to consume")
        load = Load(stack.api, "alpha", "freeze", clients=2, pause_s=0.1).start()
        wait_until(lambda: len(load.accepted) >= 30, 60, "the load to run")
        proc = reload_process(stack, {"alpha": {**ALPHA, "queue": "alpha-q2"}, "beta": BETA})
        wait_until(lambda: reloading(stack) or proc.poll() is not None, 120,
                   "the worker's reload to begin")
        os.kill(stack.redis_svc.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(FREEZE_S)  # the fault itself: Redis frozen this long
        finally:
            os.kill(stack.redis_svc.proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=300)
        print(out)
        assert proc.returncode == 0, out
        after = len(load.accepted)
        wait_until(lambda: len(load.accepted) >= after + 30, 120, "jobs after the reload")
        load.stop()
        jobs = list(load.accepted.values())
        records = settle(stack, jobs)
        print(f"\nrename across a freeze (pinned={pinned}): {len(jobs)} accepted, "
              f"{sum(r.get('status') == 'succeeded' for r in records.values())} succeeded, "
              f"{sum(int(r.get('runs') or 0) > 1 for r in records.values())} ran twice, "
              f"{sum(r.get('status') == 'queued' for r in records.values())} queued")
        assert_each_succeeded_once(records)
        assert waiting(stack, "alpha") == 0 and waiting(stack, "alpha-q2") == 0
        assert load.gave_up == []
    except BaseException:
        if proc is not None and proc.poll() is None:
            proc.kill()
        print(stack.logs())
        raise
    finally:
        if load is not None:
            load.stop()
        stack.stop()
