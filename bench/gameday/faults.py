"""The faults of a game day, one small class each: `inject` does it, `recover` undoes what
must be undone by hand (a frozen Redis resumed, an added worker removed) and returns once the
fault itself is over; what a supervisor brings back (a killed worker, a stopped Redis) the
stack's supervisor restarts (bench/gameday/stack.py). The run then waits until the stack
serves again (`Stack.serving_since`) and measures the rest from the jobs' latencies.

A fault that kills a pool child names the jobs that child was running (`may_rerun`): the only
jobs the service may run twice; so does the cut of a worker's host, whose child's batch
cannot reach Redis: to the service, that child is as gone as a killed one.

A fault's `needs` say what the stack must have beyond make run's defaults (a replicated Redis,
a models file of the run's own, a second worker on a host of its own): bench/gameday/stack.py.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import psutil
import redis
import yaml

from bench.gameday.stack import HOST_WORKER, MASTER, Needs, Stack
from scripts.run import ROOT
from scripts.stack import wait_until
from tasks.keys import JOB_PREFIX, live_key

FREEZE_S = 5.0
EXTRA_WORKER_S = 20.0  # how long the second worker serves beside the first
CUT_S = 45.0  # how long the worker's host is cut off: past the 30 s lease (visibility timeout)
# make reload's wait with no process moving on (a model load takes 6-30 s); with two workers in
# turn the whole reload is two loads, well within the wait for it below.
RELOAD_TIMEOUT_S = 300.0
FAILOVER_S = 60.0  # the sentinels' promotion, then the old primary in sync as a replica


class Fault:
    name: ClassVar[str]
    label: ClassVar[str]  # what the picture and the table call it
    needs: ClassVar[Needs] = Needs()

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


def _in_sync(client: redis.Redis) -> bool:
    links = client.info("replication")
    return links["role"] == "slave" and links.get("master_link_status") == "up"


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
        self.proc = self.stack.redis_proc()  # the primary (with replicas, the sentinels say)
        self.shell = self.proc.pid
        self.proc.signal(signal.SIGTERM)  # writes its append-only file, exits

    def recover(self) -> None:
        _restarted(self.stack, self.proc.name, self.shell)
        wait_until(lambda: self.stack.admin().ping(), 60, "Redis answering again")


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
        self.pid = self.stack.redis_proc().signal(signal.SIGSTOP)
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


class ModelReload(Fault):
    """An operator's reload (`make reload FILE=…`, scripts/reload.py, in a process of its own
    with the environment the operator's shell has beside make run): the served model's
    declared version changed in a new models file, which the reload checks, installs in place
    of the run's own and announces; each worker replaces its children one at a time, and the
    workers on a queue take turns to retire their last serving child (workers/batching/turns.py),
    so that one always serves it; each API process reloads gracefully. Over when the reload says
    every process serves the new file."""
    name, label = "model-reload", "models file reloaded"
    needs = Needs(models_copy=True)

    def inject(self) -> None:
        current = Path(self.stack.operator_env["IQ_MODELS_FILE"])
        models = yaml.safe_load(current.read_text())
        version = f"gameday-{time.strftime('%H%M%S')}"
        models["models"][self.model]["version"] = version
        edited = current.with_name("models-next.yaml")
        edited.write_text(yaml.safe_dump(models, sort_keys=False))
        self.reload = subprocess.Popen(
            [sys.executable, "-m", "scripts.reload", str(edited), "--timeout",
             str(RELOAD_TIMEOUT_S)], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=self.stack.operator_env)
        self.notes.append(f"{self.model} declared version {version}")

    def recover(self) -> None:
        out, _ = self.reload.communicate(timeout=RELOAD_TIMEOUT_S + 60)
        said = out.strip().splitlines()
        self.notes.append(f"make reload exited {self.reload.returncode}: "
                          f"{said[-1] if said else '(nothing said)'}")


class RedisFailover(Fault):
    """`SENTINEL FAILOVER` as Redis's admin (the application's user may not), on the stack as
    `REDIS_REPLICAS=1 make run` starts it: the sentinels promote the replica and demote the
    primary (closing every client's connection to it), and every process follows them. Over
    once the old primary holds the new one's data as its replica: until then the new primary
    has no replica in sync and refuses writes (make run's min-replicas-to-write), so a
    submit is refused with 503 and retried; the old primary refuses them too from the
    promotion on, instead of taking writes its demotion discards. The sentinels demote it at
    the promotion (scripts/redis-demote.sh, their client-reconfig-script): about a second,
    where Sentinel alone takes about 10 s.

    One replica, not two: with two, the old primary keeps the other replica for about a
    second after the promotion, and that replica confirms (WAIT) jobs it then drops when it
    resyncs from the promoted node: submits answered 202 and lost (README, Reliability)."""
    name, label = "redis-failover", "Redis failover"
    needs = Needs(replicas=1)

    def inject(self) -> None:
        stack = self.stack
        self.old = stack.primary_port()
        sentinel = stack.sentinel(stack.sentinel_ports[0])
        # A replica the sentinel has only heard of (from the primary's INFO) is no candidate
        # yet (NOGOODSLAVE): it must have reached it and read its link to the primary.
        wait_until(lambda: any(r["master-link-status"] == "ok" and not r["is_disconnected"]
                               for r in sentinel.sentinel_slaves(MASTER)), 30,
                   "the sentinel to reach the replica")
        self.asked = time.monotonic()
        sentinel.execute_command("SENTINEL", "FAILOVER", MASTER)

    def recover(self) -> None:
        stack = self.stack
        wait_until(lambda: stack.primary_port() != self.old, FAILOVER_S,
                   "the sentinels to promote the replica", interval=0.25)
        promoted = time.monotonic()
        old = redis.Redis(port=self.old, password=stack.admin_password, decode_responses=True,
                          socket_timeout=5, socket_connect_timeout=2)
        wait_until(lambda: _in_sync(old), FAILOVER_S, "the old primary in sync as a replica",
                   interval=0.25)
        self.notes.append(f"primary {self.old} -> {stack.primary_port()} after "
                          f"{promoted - self.asked:.1f} s; the old primary in sync as its "
                          f"replica {time.monotonic() - promoted:.1f} s later")


class HostCut(Fault):
    """A worker host cut off the network. The stack runs two workers, as a deployment over
    several machines has more than one worker host: make run's on this machine and a second
    on a host of its own (a network namespace joined to Redis's by a veth pair:
    scripts/hosts.py), which is the one cut: every packet to and from that host is dropped
    (iptables, both ways: connections hang, as on a network that went away), for longer than
    the worker's lease, then let through again. The worker on this machine serves the queue
    meanwhile, and once the cut worker's lease has lapsed it takes back what that one held;
    the cut worker must rejoin by itself. Its child's batch may run twice (`may_rerun`): its
    results cannot reach Redis."""
    name, label = "host-cut", f"a worker's host cut off {CUT_S:g} s"
    needs = Needs(own_host=True)

    def inject(self) -> None:
        host = self.stack.host
        children = {c.pid for c in self.stack.pool_children(HOST_WORKER)}
        try:
            host.cut()
        except subprocess.CalledProcessError:
            host.heal()  # half a cut (one direction) is no cut at all
            raise
        self.until = time.monotonic() + CUT_S
        try:  # its child's batch may finish, but its results cannot reach Redis: it runs again
            self.may_rerun = running_in(self.stack, children)
        except redis.RedisError as exc:
            self.notes.append(f"could not read which jobs its child was running: {exc}")
        self.notes.append(f"cut {host.name} off; its worker's child {sorted(children)} was "
                          f"running {len(self.may_rerun)} job(s)")

    def recover(self) -> None:
        time.sleep(max(self.until - time.monotonic(), 0))
        self.stack.host.heal()


FAULTS: dict[str, type[Fault]] = {f.name: f for f in (
    ChildKilled, WorkerKilled, WarmRestart, RedisRestarted, RedisClientsKilled, RedisFrozen,
    ModelReload, SecondWorker, RedisFailover, HostCut)}
