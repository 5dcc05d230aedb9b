"""Real processes for a stack on one machine (scripts/stack.py, scripts/redis_nodes.py): each
started in its own session with its output in a log file, stopped by process group."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Callable[[], object], timeout: float, what: str,
               interval: float = 0.1) -> object:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - reported below if it never succeeds
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                       + (f" (last error: {last_exc!r})" if last_exc else ""))


def signal_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> bool:
    """Send `sig` to the process group `proc` leads; False if it has already exited. (A
    function of the Popen alone: the benchmark stops a baseline commit's services, whose
    Service class is that commit's.)"""
    if proc.poll() is not None:
        return False
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def resume(pids) -> None:
    """SIGCONT each of `pids` that is still there (a test's held processes, let go)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def reap_group(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Wait for `proc` to exit; SIGKILL its group after `timeout`."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait(10)


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    log: Path
    extra: dict = field(default_factory=dict)

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def send(self, sig: int = signal.SIGTERM) -> bool:
        return signal_group(self.proc, sig)

    def reap(self, timeout: float = 20) -> None:
        reap_group(self.proc, timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.send(sig):
            self.reap(timeout)


def spawn(name: str, cmd: list[str], env: dict[str, str], logdir: Path,
          wrap: list[str] | None = None) -> Service:
    """`cmd` in a session of its own, its output in logdir/<name>.log; `wrap`: a command that
    runs it (a network namespace, a shifted clock)."""
    cmd = [*(wrap or []), *cmd]
    log = logdir / f"{name}.log"
    handle = open(log, "ab")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return Service(name, proc, log)
