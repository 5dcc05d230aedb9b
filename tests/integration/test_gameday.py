"""The game day runs end to end (a two-minute smoke of bench/gameday on the stack `make run`
starts) and counts a lost job as lost. It asserts no latency and no availability: those are
the full run's (`make gameday`), on a quiet machine."""
from __future__ import annotations

import json
import signal

import orjson
import pytest

from bench.gameday.__main__ import arguments, run
from bench.gameday.faults import ChildKilled, Fault, RedisClientsKilled
from scripts.stack import wait_until
from tasks.keys import job_key
from tasks.names import PRIORITIES, list_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("gameday")]

DELETED: list[str] = []


class MessageDeleted(Fault):
    """Not a fault to survive: a job accepted from the run's traffic whose message is taken
    off its queue and whose record is deleted, so that nothing can run, find or recover it.
    The run must count it lost. The worker's main process is held stopped meanwhile, so that
    messages wait on the queue."""
    name, label = "message-deleted", "a job's message and record deleted (test)"

    def inject(self) -> None:
        admin = self.stack.admin()
        queue = list_for(self.model, PRIORITIES["normal"])  # the traffic's jobs'
        pid = self.stack.procs["worker"].signal(signal.SIGSTOP)
        try:
            wait_until(lambda: admin.llen(queue) > 0, 30, "a message waiting on the queue")
            message = orjson.loads(admin.rpop(queue))  # the oldest
        finally:
            self.stack.procs["worker"].signal(signal.SIGCONT)
            assert self.stack.procs["worker"].program().pid == pid
        DELETED.append(message["headers"]["id"])
        admin.delete(job_key(DELETED[-1]))
        self.notes.append(f"deleted the message and the record of job {DELETED[-1]}")


def test_a_short_game_day_completes_and_counts_the_job_it_lost(tmp_path):
    args = arguments(["--minutes", "2", "--every", "35", "--rate", "5", "--drain", "60",
                      "--name", "smoke", "--out", str(tmp_path), "--var", str(tmp_path / "var")])
    report = run(args, [ChildKilled, MessageDeleted, RedisClientsKilled])

    [deleted] = DELETED
    jobs = report["jobs"]
    assert jobs["arrivals"] > 400 and jobs["accepted"] == jobs["arrivals"], jobs
    # The one job deleted, and no other: every other accepted job was read back final (on a
    # loaded machine, some after their users had stopped waiting).
    assert jobs["lost"] == 1 and jobs["lost_ids"] == [deleted], jobs
    assert jobs["final"] == jobs["arrivals"] - 1, jobs
    faults = {f["name"]: f for f in report["faults"]}
    assert list(faults) == ["child-killed", "message-deleted", "redis-clients-killed"]
    assert faults["child-killed"]["notes"][0].startswith("killed child")
    # Only jobs of the killed child's batch may have run twice.
    assert jobs["run_twice_unexplained"] == 0, jobs
    assert jobs["run_twice"] == jobs["run_twice_in_killed_batches"]
    # The target says where: in the first fault window the job lived through (on a loaded
    # machine, its message may have waited since before the deletion).
    lost = next(t for t in report["targets"] if t["target"] == "jobs lost")
    assert not lost["pass"] and len(lost["where"]) == 1, lost
    assert sum(f["lost"] for f in report["faults"]) <= 1
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["jobs"] == jobs and saved["run"]["rate"] == 5
    assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
