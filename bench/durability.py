"""What a machine crash may cost against what durability costs, side by side: Redis's
append-only file fsync'ed `everysec` (a crash can lose the last second of accepted jobs),
`always` (every write on disk before its answer), or `everysec` with a replica that holds each
job before its 202 (`everysec+replica`: Redis WAIT, IQ_REDIS_WAIT_REPLICAS=1).

`python -m bench.durability` (options: --clients 16, --seconds 8, --rounds 2, --name, --out).
For each policy, in alternating rounds on the same machine: a Redis with that policy (as
scripts/redis-server.sh starts `make run`'s; and its replica), a worker and the API on it:

1. submits through the API: `--clients` threads POST one-input jobs back to back for
   `--seconds`: accepted jobs per second, answer latency p50/p99;
2. the submit script alone (tasks/jobstate.py, what a submit costs Redis): the same threads
   call it directly;
3. a lone job's whole trip, which also pays for the worker's writes (its fetch, start,
   finish and acknowledgement): one client, one job at a time, `Prefer: wait` on a 5 ms
   synthetic model served by a worker with one child.

Also the disk's own fsync latency (a 4 KiB write and fsync, 200 times, where Redis writes).
Writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import orjson
import redis
import requests
import yaml

from bench.load import percentile
from scripts.stack import start_redis, start_web, start_worker, wait_until
from tasks.jobstate import JobState, new_job
from tasks.messages import QueuedMessage

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("everysec", "always", "everysec+replica")
MODEL = "parked"  # declared, never served: its jobs stay queued
LONE = "lone"  # served: a batch costs 5 ms


def closed_loop(clients: int, seconds: float, one: Callable[[], bool]) -> dict:
    """`clients` threads calling `one` back to back for `seconds`: calls per second that
    succeeded, latency percentiles (ms), failures."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    failures = [0] * clients
    stop = time.monotonic() + seconds

    def run(n: int) -> None:
        while time.monotonic() < stop:
            started = time.perf_counter()
            if one():
                latencies[n].append((time.perf_counter() - started) * 1000)
            else:
                failures[n] += 1

    threads = [threading.Thread(target=run, args=(n,)) for n in range(clients)]
    began = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - began
    ms = [m for part in latencies for m in part]
    return {"per_s": round(len(ms) / elapsed, 1), "p50_ms": round(percentile(ms, 50), 2),
            "p99_ms": round(percentile(ms, 99), 2), "failures": sum(failures)}


def api_submits(url: str, clients: int, seconds: float) -> dict:
    local = threading.local()

    def one() -> bool:
        session = getattr(local, "session", None) or requests.Session()
        local.session = session
        r = session.post(f"{url}/v1/jobs", json={"model": MODEL, "inputs": ["x"]}, timeout=30)
        return r.status_code == 202

    return closed_loop(clients, seconds, one)


def script_submits(redis_url: str, clients: int, seconds: float, replicas: int) -> dict:
    state = JobState(redis.Redis.from_url(redis_url, max_connections=clients + 4))

    def one() -> bool:
        job = new_job(str(uuid.uuid4()), model=MODEL, trace_id="bench", inputs=1,
                      priority="normal")
        state.submit(job, QueuedMessage("bench", orjson.dumps({"id": job.id})),
                     depth_lists=["bench"], max_depth=10**9, ttl_s=600,
                     replicas=(replicas, 1.0) if replicas else None)
        return True

    return closed_loop(clients, seconds, one)


def lone_jobs(url: str, seconds: float) -> dict:
    session = requests.Session()

    def one() -> bool:
        r = session.post(f"{url}/v1/jobs", json={"model": LONE, "inputs": ["x"]},
                         headers={"Prefer": "wait=10"}, timeout=30)
        return r.status_code == 201

    return closed_loop(1, seconds, one)


def fsync_ms(folder: Path, times: int = 200) -> dict:
    """The disk's own latency for a 4 KiB write and fsync, as Redis's `always` pays it."""
    path = folder / "fsync-probe"
    took = []
    with open(path, "wb") as out:
        for _ in range(times):
            started = time.perf_counter()
            out.write(b"\0" * 4096)
            out.flush()
            os.fsync(out.fileno())
            took.append((time.perf_counter() - started) * 1000)
    path.unlink()
    return {"p50_ms": round(percentile(took, 50), 3), "p99_ms": round(percentile(took, 99), 3)}


def one_round(workdir: Path, policy: str, clients: int, seconds: float) -> dict:
    fsync, replicas = policy.split("+")[0], int(policy.endswith("+replica"))
    redis_svc = start_redis(workdir, appendonly=True, appendfsync=fsync)
    models = workdir / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {
        MODEL: {"kind": "synthetic", "max_queue_depth": 10**9},
        LONE: {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}}))
    env = dict(os.environ, REDIS_URL=redis_svc.extra["url"], IQ_MODELS_FILE=str(models),
               IQ_LOG_LEVEL="WARNING", IQ_REDIS_WAIT_REPLICAS=str(replicas))
    services = [redis_svc]
    try:
        if replicas:
            services.append(start_redis(workdir, appendonly=True, appendfsync=fsync,
                                        replica_of=redis_svc))
        services.append(start_worker(f"durability-{policy}", env, workdir, [LONE]))
        services.append(start_web(env, workdir))
        url = services[-1].extra["url"]
        admin = redis.Redis.from_url(redis_svc.extra["admin_url"], decode_responses=True)
        assert admin.config_get("appendfsync")["appendfsync"] == fsync
        wait_until(lambda: admin.info("replication")["connected_slaves"] == replicas, 30,
                   "the replica in sync")
        wait_until(lambda: requests.get(f"{url}/readyz", timeout=5).json()["checks"]
                   [f"model:{LONE}"]["ok"], 120, "the worker")  # `parked` has none
        api_submits(url, clients, 1.0)  # warm-up
        return {"api": api_submits(url, clients, seconds),
                "script": script_submits(redis_svc.extra["url"], clients, seconds, replicas),
                "lone": lone_jobs(url, seconds)}
    finally:
        for svc in reversed(services):
            svc.stop()


def pooled(rounds: list[dict], part: str) -> dict:
    per_s = [r[part]["per_s"] for r in rounds]
    return {"per_s": round(sum(per_s) / len(per_s), 1), "rounds_per_s": per_s,
            "p50_ms": round(sum(r[part]["p50_ms"] for r in rounds) / len(rounds), 2),
            "p99_ms": round(max(r[part]["p99_ms"] for r in rounds), 2),
            "failures": sum(r[part]["failures"] for r in rounds)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.durability")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--name", default="durability")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    with tempfile.TemporaryDirectory(prefix="iq-bench-durability-") as tmp:
        disk = fsync_ms(Path(tmp))
        for n in range(args.rounds):
            for policy in POLICIES:  # alternating, so that drift on the machine hits both
                point = one_round(Path(tmp) / f"{policy}-{n}", policy, args.clients,
                                  args.seconds)
                rounds[policy].append(point)
                print(f"{policy:8} round {n + 1}: API {point['api']['per_s']} submits/s "
                      f"(p50 {point['api']['p50_ms']} ms, p99 {point['api']['p99_ms']} ms); "
                      f"script {point['script']['per_s']}/s (p50 "
                      f"{point['script']['p50_ms']} ms); a lone job p50 "
                      f"{point['lone']['p50_ms']} ms", flush=True)
    report = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0], "fsync_4k": disk},
              "clients": args.clients, "seconds": args.seconds, "rounds": args.rounds,
              "results": {policy: {part: pooled(r, part) for part in ("api", "script", "lone")}
                          for policy, r in rounds.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["results"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
