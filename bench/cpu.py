"""Where the CPU goes: configurations' stacks under a closed loop, side by side, and for each
one every process's CPU per job, Redis's commands per job (`INFO commandstats` deltas), the
worker's batch size and how much of the time its child spends in the model.

    python -m bench.cpu --model synthetic --configs service --baseline 9ccd8b9 \
        --flows prefer-wait get-wait --clients 16 --seconds 4 --rounds 3 [--profile DIR]

Every point (a configuration with a client flow) has its own stack up at once, idle but for
the one measured; rounds visit the points in rotating order and each point pools its rounds,
as `python -m bench` does. Flows: `prefer-wait` (one POST held with `Prefer: wait`) and
`get-wait` (POST, then GET ?wait); `--baseline` adds that commit's service, in its own
benchmark's flow (get-wait) unless `--flows` names more. With `--profile DIR`, one more round
per point runs with py-spy on the API and the worker's main process (not counted in the CPU
figures: sampling costs CPU) and the CPU per job measured in the counted rounds is shared out
by the samples: by function, and by what it was for. Prints one
JSON object. The worker's batch metrics exist for this service's worker only (not for the
celery-batches peer).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import redis
import requests

from bench import profile, purposes
from bench.harness import FLOWS, MODELS, Config, Stack, configs_for, start_stack
from bench.load import percentile
from bench.usage import Usage, metric_sum
from scripts.stack import wait_until

_BATCH_METRICS = ("iq_batch_jobs_count", "iq_batch_size_sum", "iq_inference_seconds_sum")


def _metrics(url: str) -> str:
    """The worker's metrics, or "" for a worker that serves none (the celery-batches peer)."""
    try:
        return requests.get(url, timeout=5).text
    except requests.RequestException:
        return ""


class Point:
    """One configuration with one client flow: its stack, and what its rounds add up to."""

    def __init__(self, stack: Stack, args: SimpleNamespace) -> None:
        self.stack, self.args = stack, args
        self.metrics_url = stack.services[1].extra["metrics_url"]
        self.usage = Usage()
        self.model: Counter[str] = Counter()
        self.wall = 0.0
        self.latencies: list[float] = []

    @property
    def name(self) -> str:
        return self.stack.config.name

    def measure(self, model: str, clients: int) -> None:
        before = _metrics(self.metrics_url)
        started = time.monotonic()
        result = self.stack.load(model, clients, 1, self.args, self.usage)
        self.wall += time.monotonic() - started
        after = _metrics(self.metrics_url)
        for metric in _BATCH_METRICS:
            self.model[metric] += metric_sum(after, metric) - metric_sum(before, metric)
        self.latencies += result["latencies_ms"]

    def profile(self, model: str, clients: int, out: Path) -> dict:
        """One round with py-spy on the API and the worker's main process."""
        groups = self.stack.meter().groups
        targets = {"api": groups["api"][0].pid, "worker main": groups["worker main"][0].pid}
        files = {name: out / f"{self.stack.config.slug}-{name.replace(' ', '-')}.txt"
                 for name in targets}
        spies = [profile.record(pid, self.args.duration, files[name])
                 for name, pid in targets.items()]
        time.sleep(0.5)  # py-spy attaches
        self.stack.load(model, clients, 1, self.args)  # not counted: sampling costs CPU
        for spy in spies:
            spy.wait(30)
        rules = {"api": profile.API_COSTS, "worker main": profile.WORKER_COSTS}
        measured = self.usage.report()["cpu_ms_per_job"]  # of the counted rounds
        return {name: {**profile.top(path, measured[name]),
                       "by_cost": profile.costs(path, measured[name], rules[name])}
                for name, path in files.items() if path.exists()}

    def scripts(self, model: str, clients: int) -> dict:
        """One more round with every command Redis runs in its SLOWLOG (not counted in the
        figures: the log costs Redis time): Redis's µs a job by what the client sent, each
        script by its name (`bench.purposes.script_names`), the commands it ran included."""
        extra = self.stack.services[0].extra
        client = redis.Redis.from_url(extra.get("admin_url", extra["url"]))
        names = purposes.script_names(self.stack.config.tree or Path.cwd())
        client.config_set("slowlog-max-len", 1_000_000)
        client.slowlog_reset()
        client.config_set("slowlog-log-slower-than", 0)
        try:
            result = self.stack.load(model, clients, 1, self.args)
        finally:
            client.config_set("slowlog-log-slower-than", 10_000)
        usec: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        for entry in client.slowlog_get(1_000_000):
            words = entry["command"].split()
            name = words[0].decode().lower() if words else "?"
            if name in ("evalsha", "eval") and len(words) > 1:
                name = names.get(words[1].decode(), words[1].decode()[:12])
            usec[name] += entry["duration"]
            calls[name] += 1
        client.slowlog_reset()
        jobs = max(result["jobs_in_run"], 1)
        return {"jobs": jobs, "usec_per_job": {n: round(us / jobs, 2)
                                               for n, us in usec.most_common()},
                "calls_per_job": {n: round(calls[n] / jobs, 3) for n, _ in usec.most_common()},
                "usec_per_call": {n: round(usec[n] / calls[n], 1) for n, _ in usec.most_common()}}

    def connections(self) -> dict:
        """The application's connections to its Redis now, by how they came: over TCP or the
        Unix socket (`service-unix`'s are all the socket's, but for the benchmark's own meter,
        which reads INFO over TCP)."""
        extra = self.stack.services[0].extra
        client = redis.Redis.from_url(extra.get("admin_url", extra["url"]))
        seen = Counter("unix" if "U" in c["flags"] else "tcp" for c in client.client_list()
                       if c.get("user") != "default" and c["id"] != str(client.client_id()))
        return dict(seen)

    def report(self, clients: int) -> dict:
        jobs = self.usage.jobs
        wall = max(self.wall, 1e-9)
        out = {"config": self.name, "flow": self.stack.config.flow, "clients": clients,
               "seconds": round(self.wall, 2), "jobs": jobs,
               "items_per_s": round(jobs / wall, 1),
               "p50_ms": round(percentile(self.latencies, 50), 1),
               **self.usage.report(),
               "cores_used": {name: round(s / wall, 2) for name, s in self.usage.cpu.items()},
               "redis_connections": self.connections()}
        batches = self.model["iq_batch_jobs_count"]  # dispatched batches, each timed once
        if batches:
            items = self.model["iq_batch_size_sum"]
            model_s = self.model["iq_inference_seconds_sum"]
            out.update(batches=int(batches), items=int(items),
                       mean_batch_items=round(items / batches, 2),
                       model_ms_per_batch=round(1000 * model_s / batches, 1),
                       model_busy=round(model_s / wall, 2))
        return out


def points_for(model: str, config_names: list[str], flows: list[str],
               baseline_rev: str | None) -> list[Config]:
    """This checkout's configurations in each flow asked for; a baseline commit in its own
    benchmark's flow and in each other flow asked for."""
    out = []
    for config in configs_for(MODELS[model], baseline_rev):
        if config.tree:
            if config.flow in flows or config.name == baseline_rev:
                out.append(config)
        elif config.name in config_names:
            for flow in flows:
                name = config.name + ("" if flow == flows[0] else f" {flow}")
                out.append(replace(config, name=name, flow=flow))
    return out


def measure(model: str, config_names: list[str], flows: list[str], clients: int,
            seconds: float, rounds: int, baseline_rev: str | None = None,
            profile_dir: Path | None = None, scripts: bool = False) -> dict:
    spec = MODELS[model]
    args = SimpleNamespace(clients=[clients], duration=seconds, warmup=0.0, flow=flows[0])
    workdir = Path(tempfile.mkdtemp(prefix="iq-bench-cpu-"))
    points: list[Point] = []
    try:
        for config in points_for(model, config_names, flows, baseline_rev):
            stack = start_stack(workdir, model, spec, config, args)
            points.append(Point(stack, args))
            wait_until(lambda: requests.get(f"{stack.url}/readyz", timeout=2).status_code
                       == 200, 180, f"{config.name} worker")
        for point in points:
            point.stack.load(model, clients, 1, args, duration=2.0, warmup=0.5)  # warm up
        for r in range(rounds):
            for point in points[r % len(points):] + points[:r % len(points)]:
                point.measure(model, clients)
        out = {"model": model, "clients": clients, "rounds": rounds,
               "seconds_per_round": seconds,
               "points": {p.name: p.report(clients) for p in points}}
        if scripts:
            for point in points:
                out["points"][point.name]["redis_by_script"] = point.scripts(model, clients)
        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
            for point in points:
                out["points"][point.name]["profile"] = point.profile(model, clients,
                                                                     profile_dir)
        return out
    finally:
        for point in points:
            point.stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="minilm-embed", choices=sorted(MODELS))
    p.add_argument("--configs", nargs="*", default=["service"],
                   choices=[c.name for c in configs_for(MODELS["minilm-embed"])])
    p.add_argument("--baseline", metavar="COMMIT", default=None,
                   help="also this commit's service, side by side (bench/baseline.py)")
    p.add_argument("--flows", nargs="+", default=[FLOWS[0]], choices=FLOWS)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="one more round per point under py-spy; raw stacks written to DIR")
    p.add_argument("--scripts", action="store_true",
                   help="one more round per point with Redis's SLOWLOG logging every "
                        "command: Redis's time a job by script")
    a = p.parse_args()
    print(json.dumps(measure(a.model, a.configs, a.flows, a.clients, a.seconds, a.rounds,
                             a.baseline, Path(a.profile) if a.profile else None,
                             a.scripts), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
