"""Waiting clients: does the API still answer while many requests wait on jobs?

`python -m bench.waiters` (options: --waiters 100 1000, --window 8, --name, --out). One Redis
and a model that no worker serves, so its jobs cannot finish; two APIs on them, side by side
in the same run: `gevent` (gunicorn.conf.py: each request a greenlet) and `gthread` (64
threads, the thread-per-wait design this replaced). For each API and each N:

1. a baseline: /healthz and submit (POST /v1/jobs) latency with nobody waiting;
2. N clients each send `GET /v1/jobs/<id>?wait=30` on a job of their own and hold it;
3. for `--window` seconds, a /healthz probe every 50 ms and a submit every 100 ms, each on
   its own connection and sent on schedule whether or not the earlier ones were answered
   (an orchestrator's probes do not queue politely either): their latency, p50/p99/max;
4. every job is cancelled through the job state (which wakes its waiters) and the waiters'
   answers are counted: 200 (the job, cancelled), 429 (no wait slot), or an error.

The client is asyncio on raw sockets, one process, so that it can hold thousands of
connections itself. Writes bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import psutil
import redis
import requests
import yaml

from bench.load import percentile
from tasks.jobstate import JobState
from scripts.stack import start_redis, start_web

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "parked"  # declared, never served: its jobs wait until cancelled
WAIT_S = 30
DESIGNS = {"gevent": None, "gthread": "gthread"}  # name -> start_web's worker_class


async def call(port: int, method: str, path: str, body: bytes = b"",
               timeout: float = 120) -> tuple[int, float]:
    """(status, seconds) of one request on a connection of its own; status 0: no answer."""
    started = time.perf_counter()
    writer = None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port), timeout)
        head = (f"{method} {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        writer.write(head.encode() + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout)
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        status = 0
    finally:
        if writer is not None:
            writer.close()
    return status, time.perf_counter() - started


SUBMIT = json.dumps({"model": MODEL, "inputs": ["x"]}).encode()


async def send_for(port: int, method: str, path: str, body: bytes, every_s: float,
                   window_s: float) -> list[asyncio.Task]:
    """Requests sent on schedule for `window_s`; their tasks, some perhaps unanswered."""
    tasks = []
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        tasks.append(asyncio.create_task(call(port, method, path, body)))
        await asyncio.sleep(every_s)
    return tasks


async def probe_loop(port: int, method: str, path: str, body: bytes, every_s: float,
                     window_s: float) -> list[tuple[int, float]]:
    return await asyncio.gather(*await send_for(port, method, path, body, every_s, window_s))


def summary(samples: list[tuple[int, float]]) -> dict:
    ok = sorted(s for status, s in samples if 200 <= status < 300)
    ms = [s * 1000 for s in ok]
    return {"n": len(samples), "ok": len(ok),
            "p50_ms": round(percentile(ms, 50), 1) if ms else None,
            "p99_ms": round(percentile(ms, 99), 1) if ms else None,
            "max_ms": round(ms[-1], 1) if ms else None,
            "over_1s": sum(1 for m in ms if m > 1000)}


def worker_rss(master_pid: int) -> int:
    """Resident memory of gunicorn's worker process(es), where the waiting happens."""
    return sum(child.memory_info().rss for child in psutil.Process(master_pid).children())


async def measure(port: int, waiters: int, window_s: float, state: JobState,
                  pid: int) -> dict:
    base_probe, base_submit = await asyncio.gather(
        probe_loop(port, "GET", "/healthz", b"", 0.05, 2.0),
        probe_loop(port, "POST", "/v1/jobs", SUBMIT, 0.1, 2.0))
    ids = [requests.post(f"http://127.0.0.1:{port}/v1/jobs", json={"model": MODEL,
                                                                     "inputs": ["x"]},
                         timeout=30).json()["id"] for _ in range(waiters)]
    waiting = [asyncio.create_task(call(port, "GET", f"/v1/jobs/{i}?wait={WAIT_S}",
                                        timeout=WAIT_S + 90)) for i in ids]
    await asyncio.sleep(1.0)  # let them arrive; they hold for WAIT_S, far past the window
    rss_before = worker_rss(pid)
    sent = await asyncio.gather(send_for(port, "GET", "/healthz", b"", 0.05, window_s),
                                send_for(port, "POST", "/v1/jobs", SUBMIT, 0.1, window_s))
    rss = max(rss_before, worker_rss(pid))
    # The window is over: cancelling every job wakes its waiter, and whatever queued behind
    # the waiters (probes, submits, other waiters) is answered at once. A probe still
    # unanswered here has waited at least until now.
    for job_id in ids:
        state.cancel(job_id)
    probes = await asyncio.gather(*sent[0])
    submits = await asyncio.gather(*sent[1])
    answers = await asyncio.gather(*waiting)
    statuses: dict[str, int] = {}
    for status, _ in answers:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {"waiters": waiters, "baseline": {"healthz": summary(base_probe),
                                              "submit": summary(base_submit)},
            "healthz": summary(probes), "submit": summary(submits),
            "waiter_answers": statuses, "api_worker_rss_mb": round(rss / 2**20, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.waiters")
    parser.add_argument("--waiters", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=list(DESIGNS))
    parser.add_argument("--name", default="waiters")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="iq-bench-waiters-"))
    models = workdir / "models.yaml"
    models.write_text(yaml.safe_dump({"models": {MODEL: {
        "kind": "synthetic", "max_queue_depth": 1_000_000}}}))
    redis_svc = start_redis(workdir)
    env = dict(os.environ, REDIS_URL=redis_svc.extra["url"], IQ_MODELS_FILE=str(models),
               IQ_LOG_LEVEL="WARNING")
    state = JobState(redis.Redis.from_url(redis_svc.extra["url"]))
    webs = {}
    results: dict[str, list[dict]] = {name: [] for name in args.designs}
    try:
        for name in args.designs:
            webs[name] = start_web(env, workdir, worker_class=DESIGNS[name])
        for waiters in args.waiters:
            for name in args.designs:  # side by side: each N on both before the next N
                web = webs[name]
                point = asyncio.run(measure(web.extra["port"], waiters, args.window, state,
                                            web.proc.pid))
                results[name].append(point)
                print(f"{name:8} {waiters:5} waiters: /healthz p50 "
                      f"{point['healthz']['p50_ms']} ms p99 {point['healthz']['p99_ms']} ms "
                      f"(idle {point['baseline']['healthz']['p99_ms']}); submit p50 "
                      f"{point['submit']['p50_ms']} p99 {point['submit']['p99_ms']} ms "
                      f"(idle {point['baseline']['submit']['p99_ms']}); waiters "
                      f"{point['waiter_answers']}", flush=True)
    finally:
        for web in webs.values():
            web.stop()
        redis_svc.stop()
    report = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": sys.version.split()[0]},
              "window_s": args.window, "wait_s": WAIT_S,
              "designs": {"gevent": "gunicorn.conf.py: gevent worker, 1 process",
                          "gthread": "gunicorn gthread worker, 1 process, 64 threads"},
              "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
