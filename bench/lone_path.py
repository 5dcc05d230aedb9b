"""Where a lone job's time goes between the client and the model: its stack (one worker, one
child, the gevent API) gets one client submitting one-input jobs back to back with
`Prefer: wait`, while Redis's MONITOR stamps every command with Redis's clock (the same host
clock as the client's). Each job's own commands mark the hops of its path:

    client sends → API's submit script → worker main's fetch script (its record) →
    child's start script → child's finish script (its "done", and the job itself sent on its
    API process's reply channel: issue 40; before it, the API read the job after the "done")
    → client has the answer

    python -m bench.lone_path --model synthetic --jobs 300 [--out FILE]

prints the p50 and mean of each stretch in ms, and one job's commands. MONITOR slows Redis a
little, so the total runs a little above `python -m bench`'s lone job.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from time import time
from types import SimpleNamespace
from urllib.parse import urlparse

import redis
import requests

from bench.harness import MODELS, configs_for, start_stack
from bench.load import make_inputs
from scripts.stack import wait_until

STRETCHES = ("client → submit", "submit → fetch", "fetch → start", "start → finish",
             "finish → client", "total")


class Monitor:
    """Redis's MONITOR in a thread: (time, client, command) for every command.

    It stops at a marker command of its own, not at a flag: the listener may run behind
    Redis, and a flag checked as it reads would drop the commands it has not read yet (the
    last job's read, say)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.commands: list[tuple[float, str, str]] = []
        self._marker = f"iq-lone-path-stop-{uuid.uuid4().hex}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        with self.client.monitor() as monitor:
            self._ready.set()
            for c in monitor.listen():
                if self._marker in c["command"]:
                    return
                self.commands.append((c["time"], f"{c['client_address']}:{c['client_port']}",
                                      c["command"]))

    def stop(self) -> None:
        self.client.echo(self._marker)
        self._thread.join(30)
        if self._thread.is_alive():
            raise RuntimeError("MONITOR's listener did not reach its stop marker in 30 s")


def names_job(job_id: str, command: str) -> bool:
    """Whether a command names the job's record key as a whole word (wherever it stands)."""
    return f"iq:job:{job_id} " in command + " "


def stretches(job_id: str, sent: float, answered: float,
              commands: list[tuple[float, str, str]]) -> dict[str, float] | None:
    """A job's stretches in seconds, from its scripts: the ones that name its record (submit,
    start, finish) and the first fetch script after its submit. The finish sends the job to
    the waiting API process, which answers from it with no read."""
    scripts = [(t, who) for t, who, cmd in commands
               if cmd.startswith("EVALSHA") and names_job(job_id, cmd)]
    if len(scripts) < 3:
        return None
    (submit, api), (start, child), (finish, _) = scripts[:3]
    fetch = next((t for t, who, cmd in commands if submit < t < start and
                  cmd.startswith("EVALSHA") and who not in (api, child)), None)
    if fetch is None:
        return None
    marks = [sent, submit, fetch, start, finish, answered]
    out = {name: b - a for name, a, b in zip(STRETCHES, marks, marks[1:])}
    out["total"] = answered - sent
    return out


def measure(model: str, jobs: int) -> dict:
    spec = MODELS[model]
    args = SimpleNamespace(clients=[1], duration=2.0, warmup=0.0, flow="prefer-wait")
    config = next(c for c in configs_for(spec) if c.name == "service")
    stack = start_stack(Path(tempfile.mkdtemp(prefix="iq-lone-")), model, spec, config, args)
    try:
        wait_until(lambda: requests.get(f"{stack.url}/readyz", timeout=2).status_code == 200,
                   180, "the worker")
        stack.load(model, 1, 1, args, duration=2.0, warmup=0.5)  # warm
        monitor = Monitor(stack.services[0].extra["admin_url"])
        url = urlparse(stack.url)
        conn = http.client.HTTPConnection(url.hostname, url.port)
        done = []
        for n in range(jobs):
            body = json.dumps({"model": model, "inputs": make_inputs(spec["kind"], 1, n)})
            sent = time()
            conn.request("POST", "/v1/jobs", body=body.encode(),
                         headers={"Content-Type": "application/json", "Prefer": "wait=30"})
            response = conn.getresponse()
            job = json.loads(response.read())
            answered = time()
            if response.status != 201:
                raise RuntimeError(f"job {n}: {response.status} {job}")
            done.append((job["id"], sent, answered))
        monitor.stop()
    finally:
        stack.stop()
    traced = {i: stretches(i, a, b, monitor.commands) for i, a, b in done}
    per_job = [s for s in traced.values() if s]
    _, sent, answered = done[len(done) // 2]
    return {
        "model": model, "jobs": len(done), "traced": len(per_job),
        # Why a job could not be traced: its own commands, for the reader to see.
        "untraced": {i: [(who, cmd[:160]) for _t, who, cmd in monitor.commands
                         if names_job(i, cmd)]
                     for i, s in traced.items() if s is None},
        "ms": {name: {"p50": round(1000 * statistics.median(s[name] for s in per_job), 3),
                      "mean": round(1000 * statistics.mean(s[name] for s in per_job), 3)}
               for name in STRETCHES} if per_job else {},
        "one_job": [(round(1000 * (t - sent), 3), who, cmd[:160])
                    for t, who, cmd in monitor.commands if sent <= t <= answered],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic", choices=sorted(MODELS))
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    report = measure(a.model, a.jobs)
    for name, ms in report["ms"].items():
        print(f"{name:18s} p50 {ms['p50']:8.3f} ms   mean {ms['mean']:8.3f} ms")
    print(f"({report['traced']} of {report['jobs']} jobs traced) one job, ms after it was sent:")
    for t, who, cmd in report["one_job"]:
        print(f"  {t:8.3f}  {who:22s} {cmd}")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
