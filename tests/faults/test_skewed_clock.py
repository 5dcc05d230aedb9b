"""Workers whose clocks are wrong, on the default settings: one 40 s ahead, one 40 s behind
(faketime), sharing one queue under load. Leases and heartbeats are judged by Redis's clock,
so neither takes the other's jobs back (40 s is past the 30 s visibility timeout either way)
and both count as consuming: every job runs exactly once.

(A pool child's own heartbeat is not checked past its first: under libfaketime, Python's
timed waits on a lock hang, libfaketime issues #390 and #469, so the child's heartbeat thread
stops after its first beat. The worker's consuming beat runs on its event loop, which works.)"""
from __future__ import annotations

import time

import pytest
import requests

from config import Settings
from scripts.stack import launch, start_worker, wait_until
from tasks.keys import CONSUMING_KEY
from tests.faults.test_recovery import Watch, check_recovery, models, submit_load
from tests.support.clock import skewed
from tests.support.records import fields

pytestmark = pytest.mark.slow

SKEW_S = 40


def consuming(stack) -> set[str]:
    """The workers whose consuming beat is younger than the heartbeat TTL, by Redis's clock."""
    now = float(stack.redis.time()[0])
    since = now - Settings().heartbeat_ttl_s
    return {w.split("@", 1)[0] for w in stack.redis.zrangebyscore(CONSUMING_KEY, since, "+inf")}


def live_instances(stack, model: str) -> int:
    checks = requests.get(f"{stack.api}/readyz", timeout=5).json()["checks"]
    return checks[f"model:{model}"]["instances"]


def test_workers_with_skewed_clocks_run_every_job_once(tmp_path):
    log = tmp_path / "runs.log"
    ahead, behind = skewed(SKEW_S), skewed(-SKEW_S)
    stack = launch(tmp_path, models(log), {}, ready_models=[], defaults=True)
    try:
        for name, wrap in (("ahead", ahead), ("behind", behind)):
            stack.workers[name] = start_worker(name, stack.env, tmp_path, ["slow"], wrap=wrap)
        wait_until(lambda: live_instances(stack, "slow") == 2, 120,
                   "both skewed workers counted live")
        watch = Watch(stack)
        accepted = submit_load(stack, watch, count=240)
        assert len(accepted) >= 200, f"only {len(accepted)} jobs accepted"
        check_recovery(stack, watch, accepted, log, time.monotonic(), may_rerun=set())
        ran_on = {fields(stack.redis, job_id).get("worker").split("@", 1)[0]
                  for job_id in accepted.values()}
        assert ran_on == {"ahead", "behind"}, f"jobs ran only on {ran_on}"
        assert consuming(stack) == {"ahead", "behind"}
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.stop()
