"""What a stack's processes spend while a load runs: CPU seconds per process group (Redis, the
worker's main process, its pool children, the API's workers) and Redis's calls per command
(`INFO commandstats`, commands run inside scripts included). Snapshots are cheap, so every
round of the benchmark takes them."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import psutil
import redis
import requests

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
    return command_stats(client)[0]


def command_stats(client: redis.Redis) -> tuple[Counter[str], Counter[str]]:
    """Calls per Redis command so far, and Redis's microseconds in each (a script's own,
    `evalsha`, include those of the commands it ran, which are counted under theirs too)."""
    stats = client.info("commandstats").items()
    return (Counter({name.removeprefix("cmdstat_"): s["calls"] for name, s in stats}),
            Counter({name.removeprefix("cmdstat_"): s["usec"] for name, s in stats}))


# The worker's device counters (workers/metrics.py): busy, and idle while work waited.
DEVICE_METRICS = ("iq_device_busy_seconds_total", "iq_device_idle_waiting_seconds_total")


def metric_sum(metrics_text: str, name: str) -> float:
    """The sum of a metric's samples (over its labels) in Prometheus text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def device_seconds(metrics_url: str | None) -> dict[str, float] | None:
    """The worker's device counters so far; None where it exports none (an earlier commit,
    the celery-batches peer) or cannot be read."""
    if not metrics_url:
        return None
    try:
        text = requests.get(metrics_url, timeout=5).text
    except requests.RequestException:
        return None
    if DEVICE_METRICS[0] not in text:
        return None
    return {name: metric_sum(text, name) for name in DEVICE_METRICS}


@dataclass
class Usage:
    """CPU, Redis commands and the device's busy and waited-idle seconds, summed over the
    rounds of one point."""
    cpu: Counter[str] = field(default_factory=Counter)
    commands: Counter[str] = field(default_factory=Counter)
    usec: Counter[str] = field(default_factory=Counter)
    jobs: int = 0
    device: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0  # of the rounds whose device counters were read

    def add(self, cpu: dict[str, float], calls: Counter[str], jobs: int,
            device: dict[str, float] | None = None, wall_s: float = 0.0,
            usec: Counter[str] | None = None) -> None:
        self.cpu.update(cpu)
        self.commands.update(calls)
        self.usec.update(usec or {})
        self.jobs += jobs
        if device is not None:
            self.device.update(device)
            self.wall_s += wall_s

    def device_busy_of_wall(self) -> float | None:
        """The device's time running model calls over the rounds' wall time, all its children
        together: its utilisation, whether or not work waited (with a second child per device
        each child's busy share counts the other's turns as its idle; this does not)."""
        if self.wall_s <= 0:
            return None
        return round(self.device[DEVICE_METRICS[0]] / self.wall_s, 3)

    def busy_share(self) -> float | None:
        """The device's busy share over the rounds (workers/child/handlers/busy.py); None where the
        worker exports no device counters."""
        busy, idle = (self.device[name] for name in DEVICE_METRICS)
        return round(busy / (busy + idle), 3) if busy + idle > 0 else None

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
            # Redis's own time in each command a job (µs; `evalsha`'s includes its scripts'
            # commands): what the Redis process's CPU a job is spent on.
            "redis_usec_per_job": {name: round(us / jobs, 2)
                                   for name, us in self.usec.most_common() if us > 0},
            "device_busy_share": self.busy_share(),
            "device_busy_of_wall": self.device_busy_of_wall(),
        }


class Meter:
    """Snapshots of one stack's processes and Redis, around each round of load."""

    def __init__(self, groups: dict[str, list[psutil.Process]], client: redis.Redis,
                 metrics_url: str | None = None) -> None:
        self.groups, self.client, self.metrics_url = groups, client, metrics_url
        self.device: dict[str, float] | None = None

    def __enter__(self) -> Meter:
        self._started = time.monotonic()
        self._calls, self._usec = command_stats(self.client)
        self._cpu = {name: cpu_seconds(procs) for name, procs in self.groups.items()}
        self._device = device_seconds(self.metrics_url)
        return self

    def __exit__(self, *_exc: object) -> None:
        self.cpu = {name: cpu_seconds(procs) - self._cpu[name]
                    for name, procs in self.groups.items()}
        calls, usec = command_stats(self.client)
        self.calls, self.usec = calls - self._calls, usec - self._usec
        self.calls["info"] -= 1  # the snapshot's own
        after = device_seconds(self.metrics_url)
        self.wall_s = time.monotonic() - self._started
        if self._device is not None and after is not None:
            self.device = {name: after[name] - self._device[name] for name in DEVICE_METRICS}
