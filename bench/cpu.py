"""Where the CPU goes: configurations' stacks under a closed loop, side by side, and for each
one every process's CPU per job, Redis's commands per job (`INFO commandstats` deltas), the
worker's batch size and how much of the time its child spends in the model.

    python -m bench.cpu --model synthetic --configs service --baseline 9ccd8b9 \
        --flows get-wait prefer-wait --clients 16 --seconds 4 --rounds 3 [--profile DIR]

Every point (a configuration and a client flow) has its own stack up at once, idle but for
the one measured; rounds visit the points in rotating order and each point pools its rounds,
as `python -m bench` does. Flows: `get-wait` (POST, then GET ?wait) and `prefer-wait` (one
POST with `Prefer: wait`). With `--profile DIR`, one more round per point runs with py-spy on
the API and the worker's main process (not counted in the CPU figures: sampling costs CPU)
and the costliest functions are reported per job. Prints one JSON object. The worker's batch
metrics exist for this service's worker only (not for the celery-batches peer).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import psutil
import redis
import requests

from bench import profile
from bench.__main__ import MODELS, Stack, api_processes, configs_for, run_load, start_stack
from tests.support.services import wait_until

FLOWS = ("get-wait", "prefer-wait")


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for proc in processes:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _sum(metrics_text: str, name: str) -> float:
    """The sum of a metric's samples (over its labels) in Prometheus text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _metrics(url: str) -> str:
    """The worker's metrics, or "" for a worker that serves none (the celery-batches peer)."""
    try:
        return requests.get(url, timeout=5).text
    except requests.RequestException:
        return ""


def _commands(client: redis.Redis) -> Counter[str]:
    """Calls per Redis command so far (commands run inside scripts included)."""
    return Counter({name.removeprefix("cmdstat_"): stats["calls"]
                    for name, stats in client.info("commandstats").items()})


class Point:
    """One configuration with one client flow: its stack, and what its rounds add up to."""

    def __init__(self, stack: Stack, flow: str) -> None:
        self.stack, self.flow = stack, flow
        self.name = stack.config.name + ("" if flow == "get-wait" else f" ({flow})")
        redis_svc, worker, _web = stack.services
        self.redis = redis.Redis.from_url(redis_svc.extra["url"])
        main = psutil.Process(worker.proc.pid)
        self.groups = {"redis": [psutil.Process(redis_svc.proc.pid)], "worker main": [main],
                       "worker child": main.children(recursive=True),
                       "api": api_processes(stack.web_pid)}
        self.metrics_url = worker.extra["metrics_url"]
        self.cpu: Counter[str] = Counter()
        self.commands: Counter[str] = Counter()
        self.model: Counter[str] = Counter()
        self.jobs = 0
        self.wall = 0.0
        self.latencies: list[float] = []

    def load(self, model: str, clients: int, seconds: float, warmup: float = 0.0) -> dict:
        return run_load(self.stack.url, model, clients, 1, seconds, warmup,
                        self.flow == "prefer-wait")

    def measure(self, model: str, clients: int, seconds: float) -> None:
        metrics_before = _metrics(self.metrics_url)
        commands_before = _commands(self.redis)
        before = {name: _cpu_seconds(procs) for name, procs in self.groups.items()}
        started = time.monotonic()
        result = self.load(model, clients, seconds)
        self.wall += time.monotonic() - started
        for name, procs in self.groups.items():
            self.cpu[name] += _cpu_seconds(procs) - before[name]
        self.commands.update(_commands(self.redis) - commands_before)
        self.commands["info"] -= 1  # this measurement's own
        metrics_after = _metrics(self.metrics_url)
        for metric in ("iq_batch_size_count", "iq_batch_size_sum", "iq_inference_seconds_sum"):
            self.model[metric] += _sum(metrics_after, metric) - _sum(metrics_before, metric)
        self.jobs += result["jobs"]
        self.latencies += result["latencies_ms"]

    def profile(self, model: str, clients: int, seconds: float, out: Path) -> dict:
        """One round with py-spy on the API and the worker's main process."""
        slug = self.name.replace(" ", "_").replace("(", "").replace(")", "")
        targets = {"api": self.groups["api"][0].pid, "worker main": self.groups["worker main"][0].pid}
        files = {name: out / f"{slug}-{name.replace(' ', '-')}.txt" for name in targets}
        spies = [profile.record(pid, seconds, files[name]) for name, pid in targets.items()]
        time.sleep(0.5)  # py-spy attaches
        result = self.load(model, clients, seconds, warmup=0.0)
        for spy in spies:
            spy.wait(30)
        return {name: profile.top(path, result["jobs"]) for name, path in files.items()
                if path.exists()}

    def report(self, clients: int) -> dict:
        from bench.load import percentile

        jobs = max(self.jobs, 1)
        cpu = {name: round(1000 * s / jobs, 3) for name, s in self.cpu.items()}
        queue_path = cpu["api"] + cpu["worker main"] + cpu["redis"]
        out = {
            "config": self.stack.config.name, "flow": self.flow, "clients": clients,
            "seconds": round(self.wall, 2), "jobs": self.jobs,
            "items_per_s": round(self.jobs / max(self.wall, 1e-9), 1),
            "p50_ms": round(percentile(self.latencies, 50), 1),
            "cpu_ms_per_job": cpu, "queue_path_cpu_ms_per_job": round(queue_path, 3),
            "cores_used": {name: round(s / max(self.wall, 1e-9), 2)
                           for name, s in self.cpu.items()},
            "redis_commands_per_job": {name: round(n / jobs, 2)
                                       for name, n in self.commands.most_common() if n > 0},
            "redis_commands_total_per_job": round(sum(n for n in self.commands.values()
                                                      if n > 0) / jobs, 2),
        }
        batches = self.model["iq_batch_size_count"]
        if batches:
            items = self.model["iq_batch_size_sum"]
            model_s = self.model["iq_inference_seconds_sum"]
            out.update(batches=int(batches), items=int(items),
                       mean_batch_items=round(items / batches, 2),
                       model_ms_per_batch=round(1000 * model_s / batches, 1),
                       model_busy=round(model_s / max(self.wall, 1e-9), 2))
        return out


def measure(model: str, config_names: list[str], flows: list[str], clients: int,
            seconds: float, rounds: int, baseline_rev: str | None = None,
            profile_dir: Path | None = None) -> dict:
    spec = MODELS[model]
    configs = [c for c in configs_for(spec, baseline_rev) if c.name in config_names or c.tree]
    workdir = Path(tempfile.mkdtemp(prefix="iq-bench-cpu-"))
    points: list[Point] = []
    stacks: list[Stack] = []
    try:
        for config in configs:
            for flow in flows:
                stack = start_stack(workdir, model, spec, config, SimpleNamespace(
                    clients=[clients]))
                stacks.append(stack)
                wait_until(lambda: requests.get(f"{stack.url}/readyz", timeout=2).status_code
                           == 200, 180, f"{config.name} worker")
                points.append(Point(stack, flow))
        for point in points:
            point.load(model, clients, 2.0, 0.5)  # warm every path first
        for r in range(rounds):
            for point in points[r % len(points):] + points[:r % len(points)]:
                point.measure(model, clients, seconds)
        out = {"model": model, "clients": clients, "rounds": rounds,
               "seconds_per_round": seconds,
               "points": {p.name: p.report(clients) for p in points}}
        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
            for point in points:
                out["points"][point.name]["profile"] = point.profile(model, clients, seconds,
                                                                     profile_dir)
        return out
    finally:
        for stack in stacks:
            stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm-embed", choices=sorted(MODELS))
    p.add_argument("--configs", nargs="*", default=["service"],
                   choices=[c.name for c in configs_for(MODELS["minilm-embed"])])
    p.add_argument("--baseline", metavar="COMMIT", default=None,
                   help="also this commit's service, side by side (bench/baseline.py)")
    p.add_argument("--flows", nargs="*", default=["get-wait"], choices=FLOWS)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="one more round per point under py-spy; raw stacks written to DIR")
    a = p.parse_args()
    print(json.dumps(measure(a.model, a.configs, a.flows, a.clients, a.seconds, a.rounds,
                             a.baseline, Path(a.profile) if a.profile else None), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
