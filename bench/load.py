"""Closed-loop load generator, run in a process of its own: N clients, each submitting a job
over HTTP and waiting for its result before submitting the next: one request a job, a
`POST /v1/jobs` with `Prefer: wait=30`, answered with the finished job (the cheapest flow,
the one the README shows first); with `--flow get-wait`, `POST /v1/jobs` and then
`GET /v1/jobs/<id>?wait=30`.

    python -m bench.load --url http://127.0.0.1:8000 --model minilm-embed --clients 16 \
        --inputs 1 --duration 10
prints one JSON object: items/s, jobs/s, p50/p99 end-to-end latency (ms), counts and every
latency sample.

A job not final within `--job-timeout` seconds of its submit is not waited on further: its
client stops and the JSON counts it under "unfinished" (with the first such job's id and
status), so that a stack that takes jobs but never finishes them (a worker that drops their
messages) ends the round instead of hanging the benchmark.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

import orjson

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Batching inference requests amortises the cost of each model call across many jobs.",
    "How are you today?",
    "A queue in front of a GPU turns bursts of traffic into full, efficient batches.",
    "Short text.",
    "Sentence embeddings place texts with similar meanings close together in vector space, "
    "which makes them useful for search, clustering and deduplication.",
]

FINAL = ("succeeded", "failed", "cancelled", "expired")
# Seconds a job may take from its submit to a final status before its client gives up on it:
# far above any job's latency in the benchmarks (seconds at most), far below their budgets.
JOB_TIMEOUT_S = 30.0


def make_inputs(model_kind: str, n: int, seed: int) -> list:
    if model_kind == "tensor":
        return [[float(seed + i)] * 4 for i in range(n)]
    return [TEXTS[(seed + i) % len(TEXTS)] for i in range(n)]


class Client(threading.Thread):
    def __init__(self, url: str, model: str, kind: str, inputs: int, stop_at: float,
                 seed: int, prefer_wait: bool = True,
                 job_timeout: float = JOB_TIMEOUT_S) -> None:
        super().__init__(daemon=True)
        parsed = urlparse(url)
        self.host, self.port = parsed.hostname, parsed.port
        self.model, self.kind, self.inputs = model, kind, inputs
        self.stop_at = stop_at
        self.seed = seed
        self.prefer_wait = prefer_wait
        self.job_timeout = job_timeout
        self.samples: list[tuple[float, float]] = []  # (finished at, latency s)
        self.errors = 0
        self.unfinished: list[dict] = []  # jobs not final within job_timeout: id, status

    def _request(self, conn, method: str, path: str, body: bytes | None = None,
                 wait: int = 30) -> dict:
        headers = {"Content-Type": "application/json"} if body else {}
        if body and self.prefer_wait:
            headers["Prefer"] = f"wait={wait}"
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        if response.status >= 400:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:200]!r}")
        # orjson: the load generator shares the machine, so it should cost it little.
        return orjson.loads(data)

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        i = 0
        while time.monotonic() < self.stop_at:
            body = json.dumps({"model": self.model,
                               "inputs": make_inputs(self.kind, self.inputs, self.seed + i)})
            i += 1
            started = time.monotonic()
            deadline = started + self.job_timeout
            try:
                state = self._request(conn, "POST", "/v1/jobs", body.encode(),
                                      self._wait(deadline))
                while state["status"] not in FINAL:
                    if time.monotonic() >= deadline:
                        # Its stack is not finishing jobs: waiting longer would hang the round.
                        self.unfinished.append({"id": state["id"], "status": state["status"]})
                        return
                    state = self._request(conn, "GET", f"/v1/jobs/{state['id']}"
                                          f"?wait={self._wait(deadline)}")
                if state["status"] != "succeeded":
                    self.errors += 1
                    continue
                self.samples.append((time.monotonic(), time.monotonic() - started))
            except Exception as exc:  # noqa: BLE001 - counted, and the connection renewed
                self.errors += 1
                print(f"client error: {exc}", file=sys.stderr)
                conn.close()
                conn = http.client.HTTPConnection(self.host, self.port, timeout=60)

    @staticmethod
    def _wait(deadline: float) -> int:
        """A request's wait: up to 30 s, and no later than the job's deadline."""
        return max(1, min(30, math.ceil(deadline - time.monotonic())))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run_load(url: str, model: str, kind: str, clients: int, inputs: int, duration: float,
             warmup: float, prefer_wait: bool = True,
             job_timeout: float = JOB_TIMEOUT_S) -> dict:
    start = time.monotonic()
    stop_at = start + warmup + duration
    threads = [Client(url, model, kind, inputs, stop_at, seed=1000 * c,
                      prefer_wait=prefer_wait, job_timeout=job_timeout)
               for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    window_start = start + warmup
    latencies = [lat for t in threads for (done, lat) in t.samples
                 if done >= window_start]
    elapsed = max(time.monotonic() - window_start, 1e-9)
    jobs = len(latencies)
    return {
        "clients": clients, "inputs_per_job": inputs, "duration_s": round(elapsed, 3),
        "jobs": jobs, "errors": sum(t.errors for t in threads),
        # Every job finished in the run, warm-up included: what a meter around the whole run
        # (bench/usage.py) divides its counts by.
        "jobs_in_run": sum(len(t.samples) for t in threads),
        "unfinished": sum(len(t.unfinished) for t in threads),
        "unfinished_jobs": [job for t in threads for job in t.unfinished][:3],
        "job_timeout_s": job_timeout,
        "jobs_per_s": jobs / elapsed, "items_per_s": jobs * inputs / elapsed,
        "p50_ms": percentile(latencies, 50) * 1000, "p99_ms": percentile(latencies, 99) * 1000,
        # Every sample, so that rounds can be pooled exactly.
        "latencies_ms": [round(lat * 1000, 3) for lat in latencies],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--kind", default="text", choices=["text", "tensor"])
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--inputs", type=int, default=1)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--flow", choices=["prefer-wait", "get-wait"], default="prefer-wait",
                   help="a job's requests: one POST with Prefer: wait=30, or POST then "
                        "GET ?wait=30")
    p.add_argument("--job-timeout", type=float, default=JOB_TIMEOUT_S,
                   help="seconds a job may take to finish before its client gives up on it "
                        "(counted under 'unfinished')")
    a = p.parse_args()
    print(json.dumps(run_load(a.url, a.model, a.kind, a.clients, a.inputs, a.duration,
                              a.warmup, a.flow == "prefer-wait", a.job_timeout)))


if __name__ == "__main__":
    main()
