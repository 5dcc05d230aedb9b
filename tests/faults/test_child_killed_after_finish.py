"""A pool child killed after its finish script stored (and acknowledged) its batch, before it
told the worker: nothing lost, none left running, none run twice, the buffered jobs served.
The stop lands as soon as the test sees the finish; on a loaded machine the child may already
have told the worker and started the next batch by then, and that batch is then one a killed
child was running: run again once, its crash counted, as any such batch."""
from __future__ import annotations

import os
import signal
import time

from scripts.stack import wait_until
from tasks.keys import job_key
from tests.faults.conftest import fault_stack
from tests.support.outcomes import assert_each_succeeded_once, settle
from tests.support.records import fields, fields_of


def test_child_killed_between_finish_and_report(tmp_path):
    stack = fault_stack(tmp_path)
    try:
        blocker = stack.submit("blocker", ["b"])
        wait_until(lambda: stack.job(blocker["id"])["status"] == "running", 30, "the blocker")
        pid = int(fields(stack.redis, blocker["id"])["worker"].rsplit("/", 1)[1])
        buffered = [stack.submit("quick", [f"q{i}"])["id"] for i in range(20)]
        r, key = stack.redis, job_key(blocker["id"])
        deadline = time.monotonic() + 30
        while r.hget(key, "status") != "succeeded":
            assert time.monotonic() < deadline
        os.kill(pid, signal.SIGSTOP)
        # the finish took the blocker's message off the in-flight record with its result
        held = [t for k in r.scan_iter("iq:inflight:*") for t in r.hvals(k)]
        assert not any(blocker["id"] in t for t in held)
        # The jobs the stopped child had started already (none when the stop came in time).
        started = {j for j, f in fields_of(r, buffered).items()
                   if f.get("status") == "running" and f.get("worker", "").endswith(f"/{pid}")}
        os.kill(pid, signal.SIGKILL)
        records = settle(stack, [blocker["id"], *buffered], timeout=120)
        assert {j: (records[j].get("runs"), records[j].get("crashes")) for j in started} == \
            {j: ("2", "1") for j in started}
        assert_each_succeeded_once({j: f for j, f in records.items() if j not in started})
        wait_until(lambda: not any(r.hlen(k) for k in r.scan_iter("*inflight*")), 30,
                   "the in-flight records empty")
        assert r.llen("iq:malformed") == 0
    finally:
        stack.stop()
