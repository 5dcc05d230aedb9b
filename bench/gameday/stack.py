"""The game day's stack: the processes `make run` starts, with its defaults, planned by
scripts/run.py's own `plan` (the Procfile's commands, each process's environment and
secrets, the readiness checks), on free ports and in a var dir of the run's own.

What some faults need beside it (`Needs`): Redis replicated as `REDIS_REPLICAS=1 make run`
replicates it (a replica and three sentinels, every process pointed at the sentinels); the
models file a copy of the default one in the var dir, for a reload to change without touching
the checkout's; a second worker on a host of its own (scripts/hosts.py), beside make run's on
this one, as a deployment over several machines has more than one worker host: it reaches
Redis over a link that can be cut, with the same settings as every other process (its
127.0.0.1 ports lead over the link: `Host.reach_loopback`). The two workers share this
machine's cores: each pool child takes half of them (IQ_CPU_THREADS), not torch's default of
all of them each.

`make run` keeps each process up under scripts/respawn.py, as a production host's supervisor
does (systemd, compose restart policies). This module is that supervisor, so that it knows
each process's pid: it starts each process as honcho would (a shell of its own session, in the
checkout), and restarts any that exits, a second later, saying so; the faults kill and stop
processes, and the supervisor brings them back.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from config import Settings
from scripts.hosts import Host
from scripts.run import ROOT, _answers, plan, process_env
from scripts.stack import free_port, wait_until
from tasks.keys import CONSUMING_KEY, live_key

RESTART_DELAY_S = 1.0
# What make run reads from the environment: the game day chooses them all (ports, var dir)
# or leaves them at their defaults, so a caller's own settings cannot leak into the run.
MAKE_RUN_VARIABLES = ("REDIS_URL", "REDIS_PORT", "REDIS_MAXMEMORY", "REDIS_REPLICAS",
                      "REDIS_SENTINEL_PORT", "REDIS_APPENDFSYNC", "REDIS_MIN_REPLICAS_TO_WRITE",
                      "REDIS_MIN_REPLICAS_MAX_LAG", "FLOWER_BASIC_AUTH",
                      "FLOWER_HOST", "FLOWER_PORT")
PORTS = ("IQ_PORT", "FLOWER_PORT", "IQ_WORKER_METRICS_PORT", "IQ_WEBHOOK_METRICS_PORT")
MASTER = Settings.redis_master  # the name the sentinels know the primary by
HOST_WORKER = "host-worker"  # the worker on a host of its own (`Needs.own_host`)
SENTINELS = 3  # scripts/run_redis.py's


@dataclass(frozen=True)
class Needs:
    """What the chosen faults need of the stack beyond `make run`'s defaults."""
    replicas: int = 0  # Redis replicas, with sentinels (REDIS_REPLICAS)
    models_copy: bool = False  # the models file a copy in the var dir
    own_host: bool = False  # a second worker, on a host of its own

    def __or__(self, other: Needs) -> Needs:
        return Needs(max(self.replicas, other.replicas), self.models_copy or other.models_copy,
                     self.own_host or other.own_host)


def free_ports(count: int, taken: set[int]) -> int:
    """The first of `count` consecutive free ports of 127.0.0.1 (a primary and its replicas
    take REDIS_PORT and the ports after it; the sentinels, REDIS_SENTINEL_PORT's), none of
    them in `taken`, to which they are added. Free is not enough: a port handed out earlier
    is free too until its process binds it, and the kernel may hand it out again (once, the
    API's and the worker's metrics got the same one and make run refused to start)."""
    def run_of_free() -> int | None:
        first = free_port()
        for port in range(first, first + count):
            if port in taken:
                return None
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    return None
        return first if first + count <= 65535 else None

    first = wait_until(run_of_free, 10, f"{count} consecutive free ports")
    taken.update(range(first, first + count))
    return first


@dataclass
class Proc:
    """One process of the stack, restarted by the supervisor whenever it exits."""
    name: str
    command: str
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen | None = None
    restarts: list[tuple[float, int]] = field(default_factory=list)  # (when, exit status)
    stopping: bool = False  # stopped on purpose: not restarted

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.command, shell=True, cwd=ROOT, env=self.env,
                                          stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def program(self) -> psutil.Process:
        """The Procfile command's program: the shell's one child (the launcher scripts exec
        it), as `ps` shows it under honcho too."""
        shell = psutil.Process(self.pid)
        kids = shell.children()
        return kids[0] if len(kids) == 1 else shell

    def signal(self, sig: int) -> int:
        """Send `sig` to the program (the worker's main process, redis-server); its pid."""
        target = self.program()
        target.send_signal(sig)
        return target.pid

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to its process group, SIGKILL to what is left after `timeout`, as honcho
        does on Ctrl-C (after 5 s there). What is waited for is every process of the group,
        not the shell alone: dash forks the command and dies at the SIGTERM at once, so a
        stop that waited for the shell left a worker in its warm shutdown while Redis was
        stopped under it (and the host of its own taken away)."""
        self.stopping = True
        if not self.alive():
            return
        try:
            shell = psutil.Process(self.pid)
            group = [shell, *shell.children(recursive=True)]
            os.killpg(self.pid, signal.SIGTERM)
        except (psutil.NoSuchProcess, ProcessLookupError):
            return
        _gone, left = psutil.wait_procs(group, timeout)
        if left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            psutil.wait_procs(left, 10)
        self.popen.wait(10)


class Stack:
    """`make run`'s processes under a supervisor. `var` holds the secrets, Redis's data and
    a log per process (`logs/<name>.log`)."""

    def __init__(self, var: Path, environ: dict[str, str] | None = None,
                 needs: Needs = Needs(), host: Host | None = None,
                 models_file: Path | None = None) -> None:
        """`host`: the host of its own `needs.own_host` asks for (scripts/hosts.py);
        `models_file`: the models file the operator sets (IQ_MODELS_FILE), else the default."""
        if needs.own_host != (host is not None):
            raise ValueError("a host is given exactly when the needs ask for one")
        self.var, self.needs, self.host = var, needs, host
        (var / "logs").mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in (environ or os.environ).items()
                if not k.startswith("IQ_") and k not in MAKE_RUN_VARIABLES}
        self.ports: set[int] = set()  # every port handed out: each one distinct
        # scripts/run.sh exports these before scripts/run.py plans the run.
        base.update({p: str(free_ports(1, self.ports)) for p in PORTS}, IQ_VAR_DIR=str(var),
                    REDIS_PORT=str(free_ports(needs.replicas + 1, self.ports)),
                    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if needs.replicas:
            base.update(REDIS_REPLICAS=str(needs.replicas),
                        REDIS_SENTINEL_PORT=str(free_ports(SENTINELS, self.ports)))
        if needs.models_copy:
            models = var / "models.yaml"
            shutil.copy(models_file or ROOT / Settings.models_file, models)
            base["IQ_MODELS_FILE"] = str(models)
        elif models_file is not None:
            base["IQ_MODELS_FILE"] = str(models_file.resolve())
        self.operator_env = base  # what an operator's shell beside make run has set
        self.run = plan(base)
        self.procs = {name: Proc(name, command, {**process_env(name, self.run.env),
                                                 **self.run.own_env.get(name, {})},
                                 var / "logs" / f"{name}.log")
                      for name, command in self.run.processes.items()}
        self.api = f"http://127.0.0.1:{self.run.env['IQ_PORT']}"
        self.admin_password = (var / "secrets" / "redis-password").read_text().strip()
        self.redis_ports = {name: int(proc.env["REDIS_PORT"]) for name, proc in
                            self.procs.items() if name == "redis" or name.startswith("redis-")}
        self.sentinel_ports = [int(proc.env["REDIS_PORT"]) for name, proc in self.procs.items()
                               if name.startswith("sentinel-")]
        self.worker_command = self.procs["worker"].command  # on this host, as make run's
        self.worker_env = dict(self.procs["worker"].env)
        self.workers = ["worker"]  # the workers the stack starts (capacity waits for each)
        self.cpu_threads: int | None = None  # IQ_CPU_THREADS, when workers share the cores
        if host is not None:
            self._on_host(host)
        self._halt = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)

    def _on_host(self, host: Host) -> None:
        """A second worker, make run's command started on `host` (a host name, so a node
        name, of its own; its metrics on the host's address, where a check reads them),
        every Redis process listening on the host's link too. Both workers' children take
        half the cores each."""
        for name in (*self.redis_ports, *(f"sentinel-{i}" for i in
                                          range(1, len(self.sentinel_ports) + 1))):
            self.procs[name].command += f" --bind 127.0.0.1 {host.gateway}"
        host.reach_loopback([*self.redis_ports.values(), *self.sentinel_ports])
        port = free_ports(1, self.ports)
        self.cpu_threads = max(1, (os.cpu_count() or 2) // 2)
        self.procs["worker"].env["IQ_CPU_THREADS"] = str(self.cpu_threads)
        env = dict(self.procs["worker"].env, IQ_WORKER_METRICS_HOST=host.address,
                   IQ_WORKER_METRICS_PORT=str(port))
        command = shlex.join(host.command(shlex.split(self.worker_command)))
        self.procs[HOST_WORKER] = Proc(HOST_WORKER, command, env,
                                       self.var / "logs" / f"{HOST_WORKER}.log")
        self.workers.append(HOST_WORKER)
        self.run.checks[f"the metrics of the worker on {host.name}"] = \
            f"http://{host.address}:{port}/metrics"

    # -- life -----------------------------------------------------------------------------
    def start(self, timeout: float = 300) -> None:
        """Start every process and return once make run would say "inference-queue is up":
        every one of its checks answers."""
        for proc in self.procs.values():
            proc.start()
        self._supervisor.start()
        for what, url in self.run.checks.items():
            wait_until(lambda url=url: _answers(url), timeout, what, interval=0.5)

    def _supervise(self) -> None:
        while not self._halt.wait(0.2):
            for proc in list(self.procs.values()):
                if proc.popen is None or proc.alive() or proc.stopping:
                    continue
                proc.restarts.append((time.monotonic(), proc.popen.returncode))
                with open(proc.log, "ab") as out:
                    out.write(f"--- gameday: {proc.name} exited "
                              f"({proc.popen.returncode}); restarting\n".encode())
                time.sleep(RESTART_DELAY_S)
                # How the run before ended, as make run's keeper tells it (scripts/respawn.py):
                # a Redis primary that shut down cleanly comes back without a handover.
                proc.env["IQ_RESPAWN_LAST_EXIT"] = str(proc.popen.returncode)
                if not self._halt.is_set() and not proc.stopping:
                    proc.start()

    def stop(self) -> None:
        self._halt.set()
        self._supervisor.join(5)
        for proc in reversed(list(self.procs.values())):
            proc.stop()

    def add_worker(self, name: str) -> Proc:
        """Another worker, as a second `scripts/worker.sh` on this machine: a node name and
        a metrics port of its own (README: give each worker a node name of its own)."""
        env = dict(self.worker_env, IQ_WORKER_NAME=name,
                   IQ_WORKER_METRICS_PORT=str(free_ports(1, self.ports)))
        proc = Proc(name, self.worker_command, env, self.var / "logs" / f"{name}.log")
        self.procs[name] = proc
        proc.start()
        return proc

    def remove(self, name: str) -> None:
        self.procs.pop(name).stop(timeout=60)

    # -- what the faults and the ledger read -------------------------------------------------
    def admin(self, **kw) -> redis.Redis:
        """A client of the primary as Redis's admin (`default`): CLIENT KILL and the like,
        which the application's user cannot run."""
        return redis.Redis(port=self.primary_port(), password=self.admin_password,
                           decode_responses=True, socket_timeout=5, socket_connect_timeout=2,
                           **kw)

    def sentinel(self, port: int) -> redis.Redis:
        """A client of a sentinel as the admin (it may fail over; the application may not)."""
        return redis.Redis(port=port, password=self.admin_password, decode_responses=True,
                           socket_timeout=5, socket_connect_timeout=2)

    def primary_port(self) -> int:
        """The port of the Redis that is the primary now: REDIS_PORT's, or the one the first
        sentinel that answers names."""
        for port in self.sentinel_ports:
            try:
                return int(self.sentinel(port).sentinel_get_master_addr_by_name(MASTER)[1])
            except (redis.RedisError, TypeError):
                continue
        return self.redis_ports["redis"]

    def redis_proc(self) -> Proc:
        """The process of the primary now (a fault that stops or freezes Redis strikes it)."""
        port = self.primary_port()
        return self.procs[next(n for n, p in self.redis_ports.items() if p == port)]

    def pool_children(self, name: str = "worker") -> list[psutil.Process]:
        """The worker's prefork pool children (spawned: their command line says so)."""
        try:
            kids = self.procs[name].program().children()
        except psutil.NoSuchProcess:
            return []
        return [k for k in kids if "spawn_main" in " ".join(_cmdline(k))]

    def cpu_seconds(self) -> dict[int, float]:
        """CPU time used so far by each process of the stack alive now (each process tree:
        redis-server, gunicorn's workers, pool children), by pid."""
        out: dict[int, float] = {}
        for proc in list(self.procs.values()):
            try:
                shell = psutil.Process(proc.pid)
                for p in [shell, *shell.children(recursive=True)]:
                    times = p.cpu_times()
                    out[p.pid] = times.user + times.system
            except psutil.Error:
                continue
        return out

    def serving_since(self, moment: float, model: str, workers: int = 1) -> bool:
        """Whether pool children with `model` have beaten their hearts, in at least `workers`
        workers whose event loops announced them consuming, since `moment` (time.time()),
        and the API is ready."""
        try:
            client = self.admin()
            consuming = {m for m, _ in client.zrangebyscore(CONSUMING_KEY, moment, "+inf",
                                                            withscores=True)}
            children = client.zrangebyscore(live_key(model), moment, "+inf")
        except redis.RedisError:
            return False
        nodes = {child.split("/", 1)[0] for child in children
                 if child.rsplit("/", 1)[0] in consuming}
        return len(nodes) >= workers and _answers(f"{self.api}/readyz")


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []
