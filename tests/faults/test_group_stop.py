"""A worker stopped as `make run` stops it (honcho signals each process's group), as systemd's
default KillMode=control-group and container runtimes do: SIGTERM to every process of the
worker, its pool child included, on the default settings, under load.

The main process does the warm shutdown (workers/batching/stopping.py): the batch its child is
running finishes in that child, which does not die of the group's SIGTERM; what waits in the buffer
goes back to its queue; the worker is gone within stop_timeout_s. Counted per job, both by the
record's `runs` (one per start by a pool child, so a batch killed half-way counts) and by the
model's log of the inputs it returned: every job ran exactly once. A batch that never returns still
does not hold the stop past stop_timeout_s: its child is killed and its job goes back. And a cold
shutdown (SIGQUIT) still stops a busy child at once: the pool kills it (SIGKILL,
workers/broker/pool.py), since the child no longer dies of the pool's SIGTERM.
"""
from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from config import Settings
from scripts.stack import launch, start_worker, wait_until
from tasks.jobstate import JobRecord
from tests.faults.test_recovery import (Watch, check_recovery, fresh_batch, held_by_workers,
                                        under_load)
from tests.support.records import fields, fields_of

pytestmark = pytest.mark.slow

STOP_S = Settings.stop_timeout_s


def models(log) -> dict:
    # 1.5 s a batch of up to 8 (test_recovery's load calls its model "slow"): a SIGTERM sent
    # as a batch is seen running lands in the middle of it.
    slow = {"kind": "synthetic", "base_ms": 1500, "per_item_ms": 0, "max_batch_size": 8,
            "max_inputs": 1, "runs_log": str(log)}
    return {"slow": slow, "stuck": {**slow, "base_ms": 100}, "cold": {**slow, "base_ms": 100}}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("group-stop")
    log = workdir / "runs.log"
    stack = launch(workdir, models(log), {"w": ["slow"], "s": ["stuck"], "c": ["cold"]}, defaults=True)
    yield stack, log
    stack.stop()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def child_of(stack, job_id: str) -> int:
    """The pid of the pool child the job's record says runs it (`node/index/pid`)."""
    return int(fields(stack.redis, job_id).get("worker").rsplit("/", 1)[1])


def hung_then_signalled(stack, model: str, worker_name: str, hang: str,
                        send) -> tuple[str, int, float]:
    """A job of `model` that hangs in its call, running; then `send(worker pid)`. Returns the
    job, the pid of the child running it and how long the worker took to exit."""
    job = stack.submit(model, [hang])["id"]
    wait_until(lambda: stack.job(job)["status"] == "running", 60, "the hung call")
    child = child_of(stack, job)
    worker = stack.workers[worker_name]
    asked = time.monotonic()
    send(worker.proc.pid)
    worker.proc.wait(STOP_S + 40)
    return job, child, time.monotonic() - asked


def test_a_stop_of_the_whole_group_lets_the_running_batch_finish_once(stopped):
    stack, log = stopped
    watch = Watch(stack)
    accepted = under_load(stack, watch)
    ids = list(accepted.values())
    worker = stack.workers["w"]
    # The SIGTERM right after a batch starts: it lands inside that batch's 1.5 s, not after a
    # batch seen running for a while (under_load's) that may end before the signal.
    held = fresh_batch(stack, ids)
    signalled, asked = time.time(), time.monotonic()
    os.killpg(worker.proc.pid, signal.SIGTERM)
    children = {child_of(stack, job_id) for job_id in held}
    worker.proc.wait(STOP_S + 30)
    took = time.monotonic() - asked
    print(f"group stop: gone after {took:.1f}s, the running batch {len(held)} job(s)")
    assert held and len(children) == 1
    assert took < STOP_S, f"the worker took {took:.1f}s to stop (stop_timeout_s {STOP_S})"
    wait_until(lambda: all(gone(pid) for pid in children), 10, "the pool child gone too")
    # The batch running at the SIGTERM was finished by the child running it, after it.
    for job_id in held:
        record = stack.redis.hgetall(f"iq:job:{job_id}")
        assert record["status"] == "succeeded", record
        assert child_of(stack, job_id) in children
        assert JobRecord.from_fields(job_id, record).finished_at.timestamp() > signalled
    assert held_by_workers(stack) == 0  # the buffered jobs are back on the queue
    stack.workers["w"] = start_worker("w", stack.env, stack.workdir, ["slow"])
    check_recovery(stack, watch, accepted, log, time.monotonic(), may_rerun=set())
    started = {job_id: int(record.get("runs") or 0)
               for job_id, record in fields_of(stack.redis, ids).items()}
    assert {job_id: n for job_id, n in started.items() if n != 1} == {}
    assert "signal 15" not in worker.tail(2000)  # no child died of the SIGTERM


def test_a_batch_that_never_returns_holds_a_group_stop_no_longer_than_its_timeout(stopped):
    stack, _log = stopped
    job, child, took = hung_then_signalled(stack, "stuck", "s", "!hang-group-stop",
                                           lambda pid: os.killpg(pid, signal.SIGTERM))
    print(f"group stop with a hung batch: gone after {took:.1f}s")
    # The child outlived the SIGTERM (the main process waited for its batch) until the stop's
    # deadline, which killed it: the stop took stop_timeout_s, and no more than a few seconds
    # beyond it.
    assert STOP_S - 1 < took < STOP_S + 10
    wait_until(lambda: gone(child), 10, "the hung child gone")
    record = stack.redis.hgetall(f"iq:job:{job}")
    assert record["status"] in ("queued", "running")
    tag = json.loads(record["message"])["properties"]["delivery_tag"]
    assert tag in {json.loads(m)["properties"]["delivery_tag"]
                   for m in stack.redis.lrange(record["list"], 0, -1)}  # back on its queue


def test_a_cold_shutdown_still_kills_a_busy_child_at_once(stopped):
    stack, _log = stopped
    # SIGQUIT to the main process only: Celery's cold shutdown.
    job, child, took = hung_then_signalled(stack, "cold", "c", "!hang-cold",
                                           lambda pid: os.kill(pid, signal.SIGQUIT))
    print(f"cold shutdown with a hung batch: gone after {took:.1f}s")
    assert took < STOP_S / 2, f"the cold shutdown waited {took:.1f}s for the hung batch"
    wait_until(lambda: gone(child), 10, "the hung child gone")
