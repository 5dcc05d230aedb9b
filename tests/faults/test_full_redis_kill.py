"""Redis full (`noeviction`, every write that needs memory refused) for 40 s, longer than both
the visibility timeout (30 s) and IQ_REDIS_RETRY_S (30 s), with a backlog, on the default
settings. Meanwhile one worker is killed outright (main process and child) holding messages,
and started again as a supervisor would, while Redis is still full. The live worker's lease
holds through the whole fault (its renewal is a write Redis never refuses), the killed one's
messages come back from its in-flight record once its lease ran out, and nothing is lost: only
what the killed worker's child had run may run a second time."""
from __future__ import annotations

import os
import signal
import time

import pytest
import redis

from scripts.stack import launch, start_worker, wait_until
from tests.faults.test_recovery import Watch, check_recovery, running_in, submit_load

# In `make test-long` (~70 s here); `make test` keeps a nearly full Redis refusing new jobs
# and finishing the accepted (test_redis_full.py).
pytestmark = [pytest.mark.slow, pytest.mark.long]

FULL_S = 40
KILL_AFTER_S = 10


def held_by(stack, node_prefix: str) -> int:
    """Messages on the in-flight records of the workers whose node name starts so."""
    client = stack.redis
    return sum(client.hlen(f"iq:inflight:{incarnation}")
               for incarnation, node in client.hgetall("iq:fetchers").items()
               if node.startswith(node_prefix))


def test_a_worker_killed_while_redis_is_full_loses_nothing(tmp_path):
    log = tmp_path / "runs.log"
    # 8 jobs a batch at 500 ms: 240 jobs are ~8 s of work for two workers, so a backlog waits
    # through the whole fault.
    models = {"slow": {"kind": "synthetic", "base_ms": 500, "per_item_ms": 0,
                       "max_batch_size": 8, "max_inputs": 1, "runs_log": str(log)}}
    stack = launch(tmp_path, models, {"a": ["slow"], "b": ["slow"]}, defaults=True)
    try:
        watch = Watch(stack)
        accepted = submit_load(stack, watch, count=240)
        assert len(accepted) >= 200, f"only {len(accepted)} jobs accepted"
        ids = list(accepted.values())
        wait_until(lambda: len(watch.first) >= 16 and running_in(stack, ids, "a@"), 60,
                   "two batches done and a running one on a")
        admin = stack.admin
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # every write that needs memory refused
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            stack.redis.set("probe", "x")
        full_at = time.monotonic()
        time.sleep(KILL_AFTER_S)  # part of the fault's length: workers go on while it is full
        held = held_by(stack, "a@")
        assert held > 0, "a held nothing when it was killed"
        victim = stack.workers["a"]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        # What a's child ran (a running batch, or finished ones whose results Redis refused)
        # is all that may run twice.
        in_batch = running_in(stack, ids, "a@")
        done_at_kill = len(watch.first)
        stack.workers["a"] = start_worker("a", stack.env, tmp_path, ["slow"])
        time.sleep(max(FULL_S - (time.monotonic() - full_at), 0))  # the rest of the fault
        assert len(watch.first) < len(ids), "the backlog was gone before the fault ended"
        admin.config_set("maxmemory", 0)
        cleared = time.monotonic()
        print(f"a held {held} message(s) when killed; {len(in_batch)} job(s) of its child "
              f"unsettled; {done_at_kill} of {len(ids)} jobs terminal at the kill")
        check_recovery(stack, watch, accepted, log, cleared, may_rerun=in_batch)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
