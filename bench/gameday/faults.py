"""The faults of a game day, one small class each: `inject` does it, `recover` undoes what
must be undone by hand (a frozen Redis resumed, an added worker removed) and returns once the
fault itself is over; what a supervisor brings back (a killed worker, a stopped Redis) the
stack's supervisor restarts (bench/gameday/stack.py). The run then waits until the stack
serves again (`Stack.serving_since`) and measures the rest from the jobs' latencies.

A fault that kills a pool child names the jobs that child was running (`may_rerun`): the only
jobs the service may run twice.
"""
from __future__ import annotations

import signal
import time
from typing import ClassVar

import psutil
import redis

from bench.gameday.stack import Stack
from scripts.stack import wait_until
from tasks.keys import JOB_PREFIX, live_key

FREEZE_S = 5.0
EXTRA_WORKER_S = 20.0  # how long the second worker serves beside the first


class Fault:
    name: ClassVar[str]
    label: ClassVar[str]  # what the picture and the table call it

    def __init__(self, stack: Stack, model: str) -> None:
        self.stack, self.model = stack, model
        self.may_rerun: set[str] = set()
        self.notes: list[str] = []

    def inject(self) -> None:
        raise NotImplementedError

    def recover(self) -> None:
        """Undo what must be undone by hand, and return once the fault is over."""


def running_in(stack: Stack, pids: set[int]) -> set[str]:
    """Jobs whose record says one of these pool children is running them (the record names
    `node/index/pid`). Read right after the kill, before any other child can start them."""
    client = stack.admin()
    keys = list(client.scan_iter(match=f"{JOB_PREFIX}*", count=5000))
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hmget(key, "status", "worker")
        rows = pipe.execute()
    return {key[len(JOB_PREFIX):] for key, (status, worker) in zip(keys, rows)
            if status == "running" and worker and int(worker.rsplit("/", 1)[1]) in pids}


def _restarted(stack: Stack, name: str, old_pid: int, timeout: float = 60) -> None:
    """Until the supervisor has started `name` again (a new process in place of old_pid)."""
    proc = stack.procs[name]
    wait_until(lambda: proc.alive() and proc.pid != old_pid, timeout,
               f"{name} restarted by the supervisor")


class ChildKilled(Fault):
    name, label = "child-killed", "pool child killed"

    def inject(self) -> None:
        children = self.stack.pool_children()
        if not children:
            self.notes.append("no pool child to kill")
            return
        children[0].send_signal(signal.SIGKILL)
        self.may_rerun = running_in(self.stack, {children[0].pid})
        self.notes.append(f"killed child {children[0].pid}, running "
                          f"{len(self.may_rerun)} job(s)")


class WorkerKilled(Fault):
    name, label = "worker-killed", "worker main process killed"

    def inject(self) -> None:
        children = {c.pid for c in self.stack.pool_children()}
        self.shell = self.stack.procs["worker"].pid
        main = self.stack.procs["worker"].signal(signal.SIGKILL)
        # Its pool child may die with it or finish its batch: only that batch may run again.
        self.may_rerun = running_in(self.stack, children)
        alive = [pid for pid in children if psutil.pid_exists(pid)]
        self.notes.append(f"killed main process {main} (children {sorted(children)}, "
                          f"still alive after the kill: {alive}); its child was running "
                          f"{len(self.may_rerun)} job(s)")

    def recover(self) -> None:
        _restarted(self.stack, "worker", self.shell)


class WarmRestart(Fault):
    name, label = "warm-restart", "worker warm restart"

    def inject(self) -> None:
        self.shell = self.stack.procs["worker"].pid
        self.stack.procs["worker"].signal(signal.SIGTERM)

    def recover(self) -> None:
        _restarted(self.stack, "worker", self.shell, timeout=120)


class RedisRestarted(Fault):
    name, label = "redis-restart", "Redis restarted"

    def inject(self) -> None:
        self.shell = self.stack.procs["redis"].pid
        self.stack.procs["redis"].signal(signal.SIGTERM)  # writes its append-only file, exits

    def recover(self) -> None:
        _restarted(self.stack, "redis", self.shell)
        wait_until(self.stack.admin().ping, 60, "Redis answering again")


class RedisClientsKilled(Fault):
    name, label = "redis-clients-killed", "every Redis connection dropped"

    def inject(self) -> None:
        admin = self.stack.admin()
        killed = sum(admin.execute_command("CLIENT", "KILL", "TYPE", kind)
                     for kind in ("normal", "pubsub"))
        self.notes.append(f"{killed} connection(s) killed")


class RedisFrozen(Fault):
    name, label = "redis-frozen", f"Redis frozen {FREEZE_S:g} s"

    def inject(self) -> None:
        self.pid = self.stack.procs["redis"].signal(signal.SIGSTOP)
        self.until = time.monotonic() + FREEZE_S

    def recover(self) -> None:
        time.sleep(max(self.until - time.monotonic(), 0))  # the fault itself: a 5 s stall
        psutil.Process(self.pid).send_signal(signal.SIGCONT)


class SecondWorker(Fault):
    name, label = "second-worker", "second worker added, removed"
    worker = "gameday-extra"

    def inject(self) -> None:
        started = time.time()
        self.stack.add_worker(self.worker)
        try:
            wait_until(lambda: self._serving(started), 120, "the second worker serving")
        except TimeoutError:
            self.notes.append("the second worker was not serving after 120 s")
        self.until = time.monotonic() + EXTRA_WORKER_S

    def _serving(self, since: float) -> bool:
        try:
            members = self.stack.admin().zrangebyscore(live_key(self.model), since, "+inf")
        except redis.RedisError:
            return False
        return any(m.startswith(f"{self.worker}@") for m in members)

    def recover(self) -> None:
        time.sleep(max(self.until - time.monotonic(), 0))
        self.stack.remove(self.worker)  # as make run stops it: SIGTERM to its group


FAULTS: dict[str, type[Fault]] = {f.name: f for f in (
    ChildKilled, WorkerKilled, WarmRestart, RedisRestarted, RedisClientsKilled, RedisFrozen,
    SecondWorker)}
