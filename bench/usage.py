"""What a stack's processes spend while a load runs: CPU seconds per process group (Redis, the
worker's main process, its pool children, the API's workers) and Redis's calls per command
(`INFO commandstats`, commands run inside scripts included). Snapshots are cheap, so every
round of the benchmark takes them."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import psutil
import redis

GROUPS = ("api", "worker main", "worker child", "redis")
QUEUE_PATH = ("api", "worker main", "redis")  # the shared per-job work, the model's child aside


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def commands(client: redis.Redis) -> Counter[str]:
    """Calls per Redis command so far."""
    return Counter({name.removeprefix("cmdstat_"): stats["calls"]
                    for name, stats in client.info("commandstats").items()})


@dataclass
class Usage:
    """CPU and Redis commands summed over the rounds of one point."""
    cpu: Counter[str] = field(default_factory=Counter)
    commands: Counter[str] = field(default_factory=Counter)
    jobs: int = 0

    def add(self, cpu: dict[str, float], calls: Counter[str], jobs: int) -> None:
        self.cpu.update(cpu)
        self.commands.update(calls)
        self.jobs += jobs

    def report(self) -> dict:
        jobs = max(self.jobs, 1)
        cpu = {name: round(1000 * self.cpu[name] / jobs, 3) for name in GROUPS}
        return {
            "cpu_ms_per_job": cpu,
            "queue_path_cpu_ms_per_job": round(sum(cpu[g] for g in QUEUE_PATH), 3),
            "redis_commands_per_job": {name: round(n / jobs, 2)
                                       for name, n in self.commands.most_common() if n > 0},
            "redis_commands_total_per_job": round(sum(n for n in self.commands.values()
                                                      if n > 0) / jobs, 2),
        }


class Meter:
    """Snapshots of one stack's processes and Redis, around each round of load."""

    def __init__(self, groups: dict[str, list[psutil.Process]], client: redis.Redis) -> None:
        self.groups, self.client = groups, client

    def __enter__(self) -> Meter:
        self._calls = commands(self.client)
        self._cpu = {name: cpu_seconds(procs) for name, procs in self.groups.items()}
        return self

    def __exit__(self, *_exc: object) -> None:
        self.cpu = {name: cpu_seconds(procs) - self._cpu[name]
                    for name, procs in self.groups.items()}
        self.calls = commands(self.client) - self._calls
        self.calls["info"] -= 1  # the snapshot's own
