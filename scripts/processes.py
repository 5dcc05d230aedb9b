"""Real processes for a stack on one machine (scripts/stack.py, scripts/redis_nodes.py): each
started in its own session with its output in a log file, stopped by process group."""
from __future__ import annotations

import os
import random
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


def _ephemeral_ports() -> range:
    """The ports the kernel gives outgoing connections (net.ipv4.ip_local_port_range)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


_HANDED_OUT: set[int] = set()  # this process's, never given twice


def free_port() -> int:
    """A loopback port nothing listens on, below the kernel's ephemeral range. A port the
    kernel hands out itself (bind to 0) may be taken as the source port of any outgoing
    connection in the moment before the server started on it binds it; one below that range
    only by another listener, which the check here sees."""
    ephemeral = _ephemeral_ports()
    low, high = 10000, (ephemeral.start - 1 if ephemeral.start > 11000 else 65535)
    # Each pytest-xdist worker its own slice, so that two never pick the same port.
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.isdigit() and count > 1:
        width = (high - low + 1) // count
        low = low + int(worker) % count * width
        high = low + width - 1
    for _ in range(200):
        port = random.randint(low, high)
        if port in ephemeral or port in _HANDED_OUT:
            continue  # one handed out already may not be bound yet (several set up at once)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free loopback port in {low}-{high} outside {ephemeral}")


class Exited(RuntimeError):
    """A process waited for exited instead (Service.wait_ready)."""


def wait_until(check: Callable[[], object], timeout: float, what: str,
               interval: float = 0.1, fatal: tuple[type[Exception], ...] = ()) -> object:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout`, or at
    once if `check` raises one of `fatal`."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except fatal:
            raise
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

    def wait_ready(self, check: Callable[[], object], timeout: float, what: str) -> object:
        """wait_until(check), failing at once, with the end of its log, if the process exits
        first (a port taken, a bad option) rather than after `timeout`."""
        def ready() -> object:
            if self.proc.poll() is not None:
                raise Exited(f"{what}: exited ({self.proc.returncode}) before it was ready; "
                             f"the end of {self.log}:\n{self.tail(20)}")
            return check()

        return wait_until(ready, timeout, what, fatal=(Exited,))

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
