"""The game day runs end to end (a minute-and-a-half smoke of bench/gameday on the stack
`make run` starts) and counts a lost job as lost. It asserts no latency and no availability: those are
the full run's (`make gameday`), on a quiet machine."""
from __future__ import annotations

import json
import os
import signal

import orjson
import pytest

from bench.gameday.__main__ import arguments, run
from bench.gameday.faults import FAULTS, ChildKilled, Fault, RedisClientsKilled
from bench.gameday.stack import HOST_WORKER, Needs, Stack
from config import Settings
from scripts import hosts
from scripts.stack import wait_until
from tests.support.tools import require
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
    args = arguments(["--minutes", "1.5", "--every", "25", "--rate", "5", "--drain", "60",
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


def test_the_stack_has_what_the_chosen_faults_need(tmp_path):
    """Planned, not started: a failover's stack is `REDIS_REPLICAS=1 make run`'s (a replica
    and three sentinels, each with its own environment, every application process pointed at
    the sentinels); a reload's, a models file of the run's own with the default's bytes; a host
    cut's, make run's worker here and a second on its host with make run's Redis settings,
    each child on half the cores, every Redis process also listening on the host's link."""
    needs = [FAULTS[name].needs for name in ("redis-failover", "model-reload", "host-cut")]
    assert needs == [Needs(replicas=1), Needs(models_copy=True), Needs(own_host=True)]
    assert {f.needs for f in FAULTS.values()} - set(needs) == {Needs()}

    stack = Stack(tmp_path / "plain")
    assert sorted(stack.procs) == ["flower", "redis", "web", "webhooks", "worker"]
    assert stack.procs["worker"].command == "scripts/worker.sh"
    assert stack.workers == ["worker"] and "IQ_CPU_THREADS" not in stack.procs["worker"].env

    stack = Stack(tmp_path / "failover", needs=Needs(replicas=1, models_copy=True))
    redis_procs = {n: p for n, p in stack.procs.items() if n.startswith(("redis", "sentinel"))}
    assert len(redis_procs) == 5 and len(stack.sentinel_ports) == 3
    primary = stack.redis_ports["redis"]
    assert sorted(stack.redis_ports.values()) == [primary, primary + 1]
    replica = next(p for n, p in redis_procs.items() if n.startswith("redis-"))
    assert replica.env["REDIS_REPLICA_OF"] == f"127.0.0.1:{primary}"
    # Every node refuses writes while a primary without a replica in sync (any may be one).
    assert {stack.procs[n].env["REDIS_MIN_REPLICAS_TO_WRITE"] for n in stack.redis_ports} == {"1"}
    for i, port in enumerate(stack.sentinel_ports, 1):
        assert stack.procs[f"sentinel-{i}"].env["REDIS_PORT"] == str(port)
        assert stack.procs[f"sentinel-{i}"].env["REDIS_SENTINEL_MONITOR"] == \
            f"127.0.0.1:{primary}"
    for name in ("web", "worker", "webhooks", "flower"):
        assert stack.procs[name].env["IQ_REDIS_SENTINELS"] == ",".join(
            f"127.0.0.1:{p}" for p in stack.sentinel_ports)
    models = stack.procs["worker"].env["IQ_MODELS_FILE"]
    assert models == str(tmp_path / "failover" / "models.yaml")
    assert open(models, "rb").read() == open(Settings.models_file, "rb").read()
    assert stack.primary_port() == primary  # no sentinel answers: REDIS_PORT's node

    require("iptables")
    why = hosts.unavailable()
    if why:
        pytest.skip(f"no host of its own here: {why}")
    with hosts.hosts(1) as [host]:
        stack = Stack(tmp_path / "cut", needs=Needs(own_host=True), host=host)
        # make run's worker stays on this machine; a second one runs on the host of its own.
        assert stack.workers == ["worker", HOST_WORKER]
        local, remote = stack.procs["worker"], stack.procs[HOST_WORKER]
        assert local.command == "scripts/worker.sh"
        assert remote.command.startswith(f"ip netns exec {host.name} ")
        assert remote.command.endswith(" scripts/worker.sh")
        assert remote.env["REDIS_URL"] == local.env["REDIS_URL"]  # make run's own
        assert stack.procs["redis"].command.endswith(f" --bind 127.0.0.1 {host.gateway}")
        assert remote.env["IQ_WORKER_METRICS_HOST"] == host.address
        assert local.env["IQ_WORKER_METRICS_HOST"] == "127.0.0.1"
        assert remote.env["IQ_WORKER_METRICS_PORT"] != local.env["IQ_WORKER_METRICS_PORT"]
        checks = " ".join(stack.run.checks.values())
        assert f"http://{host.address}:{remote.env['IQ_WORKER_METRICS_PORT']}/" in checks
        assert f"http://127.0.0.1:{local.env['IQ_WORKER_METRICS_PORT']}/" in checks
        # The two share this machine's cores: half of them each, not all of them each.
        threads = str(max(1, os.cpu_count() // 2))
        assert local.env["IQ_CPU_THREADS"] == remote.env["IQ_CPU_THREADS"] == threads
        # A second worker is started on this machine, as make run's.
        assert stack.worker_command == "scripts/worker.sh"
