"""What a running Celery worker reports of itself, through the celery CLI as an operator asks,
and what its processes are."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import psutil

from scripts.stack import ROOT, wait_until


def node(name: str) -> str:
    return f"{name}@{socket.gethostname()}"


def prefetch_count(stack, name: str) -> int:
    """The worker's prefetch as Celery reports it (`inspect stats`: its live QoS), once it
    answers (a worker that just reconnected answers once its control consumer is back)."""
    def stats() -> int | None:
        out = subprocess.run([sys.executable, "-m", "celery", "-A", "tasks.cli", "inspect",
                              "stats", "-d", node(name), "--json", "-t", "5"], cwd=ROOT,
                             env=stack.env, capture_output=True, text=True, timeout=60).stdout
        line = next((line for line in out.splitlines() if line.startswith("{")), None)
        return json.loads(line)[node(name)]["prefetch_count"] if line else None

    return wait_until(stats, 60, f"worker {name} to answer `inspect stats`")


def pool_children(worker: psutil.Process) -> list[psutil.Process]:
    """The worker's live pool children (not billiard's semaphore tracker, its child too)."""
    return [p for p in worker.children() if p.status() != psutil.STATUS_ZOMBIE
            and "semaphore_tracker" not in " ".join(p.cmdline())]
