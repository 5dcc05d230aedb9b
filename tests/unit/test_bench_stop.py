"""A benchmark stops every stack it started, a baseline's included: a baseline's services come
from that commit's launcher, whose Service class may be older than this checkout's (8fe1eee's
has no `send`, which crashed `stop_all` and left both stacks running)."""
from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import Stack, stop_all
from scripts.processes import Service


@dataclass
class OldService:
    """A Service as 8fe1eee's launcher made it: `stop` and nothing else."""
    name: str
    proc: subprocess.Popen
    log: Path
    extra: dict = field(default_factory=dict)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        raise AssertionError("stop_all must not need a launcher's own methods")


def _sleeper(kind, name: str, tmp_path: Path):
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    return kind(name, proc, tmp_path / f"{name}.log")


def _stack(kind, tmp_path: Path) -> Stack:
    services = [_sleeper(kind, n, tmp_path) for n in ("redis", "worker", "web")]
    return Stack(config=None, services=services, url="", web_pid=services[2].proc.pid)


def test_stop_all_stops_a_baseline_stack_from_an_older_launcher_and_the_current_one(tmp_path):
    stacks = [_stack(Service, tmp_path), _stack(OldService, tmp_path)]
    try:
        stop_all(stacks)
        assert [svc.proc.poll() for stack in stacks for svc in stack.services] == \
            [-signal.SIGTERM] * 6
    finally:
        for svc in (svc for stack in stacks for svc in stack.services):
            if svc.proc.poll() is None:
                svc.proc.kill()
                svc.proc.wait()
