"""Workers cut off from Redis on the default settings: each runs in a network namespace joined to
this host by a veth pair, and the cut drops every packet both ways (iptables, inside the
namespace), the connections left open and silent, for longer than the lease (30 s). One cut
worker is idle in its blocking wait, the other busy under load, while a worker on the host
lives on. Nothing accepted is lost; only the jobs the busy worker's child was running at the
cut may run a second time (on the host worker, once the cut worker's lease ran out)."""
from __future__ import annotations

import time
from time import monotonic

import pytest

from scripts.stack import launch, start_worker
from tests.faults.test_recovery import (Watch, check_recovery, fresh_batch, running_in, runs,
                                        submit_load)
from tests.support.netns import namespace

# In `make test-long` (~70 s here); `make test` keeps a host cut off from Redis past the
# visibility timeout (test_hosts.py).
pytestmark = [pytest.mark.slow, pytest.mark.long]

CUT_S = 45


def test_workers_cut_off_from_redis_lose_nothing(tmp_path):
    log = tmp_path / "runs.log"
    models = {"slow": {"kind": "synthetic", "base_ms": 500, "per_item_ms": 0,
                       "max_batch_size": 8, "max_inputs": 1, "runs_log": str(log)},
              "idle": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0,
                       "runs_log": str(log)}}
    with namespace() as ns:
        stack = launch(tmp_path, models, {"host": ["slow"]}, ready_models=["slow"],
                       defaults=True, redis_args=["--bind", "127.0.0.1", ns.host_address])
        try:
            env = dict(stack.env, REDIS_URL=stack.redis_url.replace("127.0.0.1",
                                                                    ns.host_address))
            for name, queues in (("busy", ["slow"]), ("idle", ["idle"])):
                stack.workers[name] = start_worker(name, env, tmp_path, queues,
                                                   wrap=ns.prefix)
            stack.wait_live(["slow", "idle"], 120)
            watch = Watch(stack)
            accepted = submit_load(stack, watch, count=200)
            ids = list(accepted.values())
            fresh_batch(stack, ids, "busy@")  # the cut lands early in that batch
            ns.cut()
            cut_at = monotonic()
            # What the cut worker's child runs now is all that may run twice: after the cut it
            # can start nothing (its start cannot reach Redis).
            in_batch = running_in(stack, ids, "busy@")
            assert in_batch, "the cut came when the busy worker ran no batch"
            idle_job = stack.submit("idle", ["idle-job"])["id"]
            watch.ids.append(idle_job)
            time.sleep(max(CUT_S - (monotonic() - cut_at), 0))  # the fault's length
            ns.restore()
            cleared = monotonic()
            check_recovery(stack, watch, {**accepted, "idle-job": idle_job}, log, cleared,
                           may_rerun=in_batch)
            assert runs(log)["idle-job"] == 1
            stack.wait_live(["idle"], 60)  # the idle worker is back at work
        except BaseException:
            print(stack.logs())
            raise
        finally:
            stack.stop()
