"""The game day's stack: the processes `make run` starts, with its defaults, planned by
scripts/run.py's own `plan` (the Procfile's commands, each process's environment and
secrets, the readiness checks), on free ports and in a var dir of the run's own.

`make run` keeps each process up under scripts/respawn.py, as a production host's supervisor
does (systemd, compose restart policies). This module is that supervisor, so that it knows
each process's pid: it starts each process as honcho would (a shell of its own session, in the
checkout), and restarts any that exits, a second later, saying so; the faults kill and stop
processes, and the supervisor brings them back.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from scripts.run import ROOT, _answers, plan, process_env
from scripts.stack import free_port, wait_until
from tasks.keys import CONSUMING_KEY, live_key

RESTART_DELAY_S = 1.0
# What make run reads from the environment: the game day chooses them all (ports, var dir)
# or leaves them at their defaults, so a caller's own settings cannot leak into the run.
MAKE_RUN_VARIABLES = ("REDIS_URL", "REDIS_PORT", "REDIS_MAXMEMORY", "FLOWER_BASIC_AUTH",
                      "FLOWER_HOST", "FLOWER_PORT")
PORTS = ("REDIS_PORT", "IQ_PORT", "FLOWER_PORT", "IQ_WORKER_METRICS_PORT",
         "IQ_WEBHOOK_METRICS_PORT")


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
        does on Ctrl-C (after 5 s there)."""
        self.stopping = True
        if not self.alive():
            return
        try:
            os.killpg(self.pid, signal.SIGTERM)
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait(10)
        except ProcessLookupError:
            pass


class Stack:
    """`make run`'s processes under a supervisor. `var` holds the secrets, Redis's data and
    a log per process (`logs/<name>.log`)."""

    def __init__(self, var: Path, environ: dict[str, str] | None = None) -> None:
        self.var = var
        (var / "logs").mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in (environ or os.environ).items()
                if not k.startswith("IQ_") and k not in MAKE_RUN_VARIABLES}
        # scripts/run.sh exports these before scripts/run.py plans the run.
        base.update({p: str(free_port()) for p in PORTS}, IQ_VAR_DIR=str(var),
                    HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.run = plan(base)
        self.procs = {name: Proc(name, command, process_env(name, self.run.env),
                                 var / "logs" / f"{name}.log")
                      for name, command in self.run.processes.items()}
        self.api = f"http://127.0.0.1:{self.run.env['IQ_PORT']}"
        admin_password = (var / "secrets" / "redis-password").read_text().strip()
        self.admin_url = f"redis://:{admin_password}@127.0.0.1:{self.run.env['REDIS_PORT']}/0"
        self.redis_url = self.run.env["REDIS_URL"]
        self._halt = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)

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
                if not self._halt.is_set() and not proc.stopping:
                    proc.start()

    def stop(self) -> None:
        self._halt.set()
        self._supervisor.join(5)
        for proc in reversed(list(self.procs.values())):
            proc.stop()

    def add_worker(self, name: str) -> Proc:
        """Another worker, as a second `scripts/worker.sh` beside the first: a node name and
        a metrics port of its own (README: give each worker a node name of its own)."""
        env = dict(self.procs["worker"].env, IQ_WORKER_NAME=name,
                   IQ_WORKER_METRICS_PORT=str(free_port()))
        proc = Proc(name, self.procs["worker"].command, env, self.var / "logs" / f"{name}.log")
        self.procs[name] = proc
        proc.start()
        return proc

    def remove(self, name: str) -> None:
        self.procs.pop(name).stop(timeout=60)

    # -- what the faults and the ledger read -------------------------------------------------
    def admin(self, **kw) -> redis.Redis:
        """A client as Redis's admin (`default`): CLIENT KILL and the like, which the
        application's user cannot run."""
        return redis.Redis.from_url(self.admin_url, decode_responses=True,
                                    socket_timeout=5, socket_connect_timeout=2, **kw)

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

    def serving_since(self, moment: float, model: str) -> bool:
        """Whether a pool child with `model` has beaten its heart, in a worker whose event
        loop announced it consuming, since `moment` (time.time()), and the API is ready."""
        try:
            client = self.admin()
            consuming = {m for m, _ in client.zrangebyscore(CONSUMING_KEY, moment, "+inf",
                                                            withscores=True)}
            children = client.zrangebyscore(live_key(model), moment, "+inf")
        except redis.RedisError:
            return False
        fresh = any(child.rsplit("/", 1)[0] in consuming for child in children)
        return fresh and _answers(f"{self.api}/readyz")


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []
