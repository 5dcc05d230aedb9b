"""Playing a game day on a started stack: the stack's capacity measured first, then open-loop
traffic (bench/gameday/traffic.py, a process of its own) while the faults strike on their
schedule, then a drain, then every accepted job's record read straight from Redis (once the
jobs still late have finished).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from bench.gameday.faults import Fault
from bench.gameday.stack import Stack
from scripts.run import ROOT
from scripts.stack import wait_until
from tasks.keys import JOB_PREFIX, idempotency_key

DRAIN_S = 120.0  # after the last arrival, how long the traffic's users wait for their jobs
# Then, how long the read-back waits for the jobs still queued or running: while some finish,
# until SETTLE_STALL_S pass without one (a dead worker's messages come back after the 30 s
# visibility timeout), SETTLE_MOST_S at most.
SETTLE_STALL_S = 90.0
SETTLE_MOST_S = 600.0


@dataclass
class Struck:
    """One fault as it happened (time.monotonic() times): injected, over (`recover`
    returned), and the stack serving again after it (None: not before the next fault's turn,
    or the end of the traffic for the last)."""
    name: str
    label: str
    scheduled: float
    injected: float
    over: float
    serving: float | None
    may_rerun: list[str]
    notes: list[str]


@dataclass
class Played:
    rate: float
    start: float  # the first second of arrivals (time.monotonic())
    end: float  # the last
    jobs: list[dict]  # one per arrival, from the traffic
    summary: dict  # the traffic's answers, 5xx and retries
    struck: list[Struck]
    # A second each: [t, machine %, stack %, the machine's 1-minute load average]
    cpu: list[list[float]] = field(default_factory=list)
    records: dict[str, dict] = field(default_factory=dict)  # job id: status, runs
    unanswered: dict[str, dict] = field(default_factory=dict)  # token: its job, if it exists
    settled_s: float = 0.0  # how long the read-back waited for late jobs to finish


def traffic(url: str, model: str, run: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bench.gameday.traffic", "--url", url, "--model", model,
            "--run", run, *extra]


# The Python client from this checkout (client/), as the tests import it: it is a package of
# its own, which the virtualenv does not install.
CLIENT_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    filter(None, [str(ROOT / "client"), os.environ.get("PYTHONPATH")])))


def capacity(stack: Stack, model: str, users: int = 32, seconds: float = 20) -> dict:
    """Jobs a second the stack completes with the game day's mix from `users` closed-loop
    users (each waits for its job before the next): the rate the run takes a share of.
    Measured once a pool child of every worker serves `model` (/readyz answers as soon as a
    worker consumes, while its child may still be loading: at load 22, 40 s, and the stack
    seemed to complete nothing; with two workers, the capacity is both's)."""
    wait_until(lambda: stack.serving_since(time.time() - 30, model, len(stack.workers)), 600,
               f"a pool child of each of {stack.workers} serving {model}", interval=0.5)
    out = subprocess.run(traffic(stack.api, model, f"cap{uuid.uuid4().hex[:6]}", "--capacity",
                                 str(users), "--duration", str(seconds)),
                         capture_output=True, text=True, check=True, cwd=ROOT, env=CLIENT_ENV)
    return json.loads(out.stdout)


def schedule(faults: list[type[Fault]], start: float, every: float) -> list[tuple[float, type]]:
    """A fault every `every` seconds, the first half a period in (after a baseline)."""
    return [(start + every / 2 + i * every, fault) for i, fault in enumerate(faults)]


def play(stack: Stack, model: str, faults: list[type[Fault]], rate: float, seconds: float,
         every: float = 60.0, drain: float = DRAIN_S, out: Path | None = None) -> Played:
    """Traffic for `seconds` (longer if the last fault needs it: it gets `every` seconds of
    traffic after it), the faults on their schedule, then up to `drain` seconds for the jobs
    still waiting."""
    out = out or stack.var / "jobs.jsonl"
    start = time.monotonic() + 3  # the traffic process's own start-up
    plan = schedule(faults, start, every)
    end = max(start + seconds, plan[-1][0] + every if plan else 0)
    proc = subprocess.Popen(traffic(stack.api, model, uuid.uuid4().hex[:8], "--rate", str(rate),
                                    "--start", str(start), "--duration", str(end - start),
                                    "--deadline", str(end + drain), "--out", str(out)),
                            cwd=ROOT, env=CLIENT_ENV)
    try:
        with CpuMeter(stack) as cpu:
            turns = [at for at, _ in plan[1:]] + [end]
            struck = [strike(stack, model, fault, at, until)
                      for (at, fault), until in zip(plan, turns)]
            if proc.wait() != 0:
                raise RuntimeError(f"the traffic process exited with {proc.returncode}")
    finally:  # a run stopped early (Ctrl-C, SIGTERM) stops its traffic too
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    played = Played(rate, start, end, [r for r in rows if "summary" not in r],
                    next(r["summary"] for r in rows if "summary" in r), struck,
                    [[round(t - start, 1), *rest] for t, *rest in cpu.samples])
    read_back(stack, played)
    return played


class CpuMeter:
    """Once a second, how busy the machine's CPUs were and how much of that was the stack's
    (100 % = one core busy for the second), and the machine's load average: on a shared
    machine, whether the stack had the CPU it needed."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.samples = stack, []
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._thread.join(5)

    def _run(self) -> None:
        busy, used, at = _busy(), self.stack.cpu_seconds(), time.monotonic()
        while not self._halt.wait(1.0):
            now_busy, now_used, now = _busy(), self.stack.cpu_seconds(), time.monotonic()
            # A process started since counts from zero; one gone since, not at all.
            spent = sum(cpu - used.get(pid, 0.0) for pid, cpu in now_used.items())
            span = now - at
            self.samples.append((now, round(100 * (now_busy - busy) / span),
                                 round(100 * spent / span), round(os.getloadavg()[0], 2)))
            busy, used, at = now_busy, now_used, now


def _busy() -> float:
    """CPU seconds the machine spent on anything but idling, all cores together."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def strike(stack: Stack, model: str, kind: type[Fault], at: float, until: float) -> Struck:
    """The fault at its turn, and until the stack serves again, at most until `until` (the
    next fault keeps its turn: a schedule does not wait)."""
    time.sleep(max(at - time.monotonic(), 0))
    fault = kind(stack, model)
    injected, wall = time.monotonic(), time.time()
    try:
        fault.inject()
        fault.recover()
    except Exception as exc:  # noqa: BLE001 - a fault that could not be done or undone is
        fault.notes.append(f"{type(exc).__name__}: {exc}")  # reported, and the run goes on
    over, over_wall = time.monotonic(), time.time()
    try:
        wait_until(lambda: stack.serving_since(max(over_wall, wall + 0.5), model),
                   max(until - time.monotonic(), 1.0), "the stack serving again",
                   interval=0.25)
        serving = time.monotonic()
    except TimeoutError:
        serving = None
    print(f"gameday: {fault.name} at {injected - at:+.1f} s of its slot, over after "
          f"{over - injected:.1f} s, serving after "
          f"{'-' if serving is None else f'{serving - injected:.1f} s'}; "
          f"{'; '.join(fault.notes)}", flush=True)
    return Struck(fault.name, fault.label, at, injected, over, serving,
                  sorted(fault.may_rerun), fault.notes)


def read_back(stack: Stack, played: Played, stall: float = SETTLE_STALL_S,
              most: float = SETTLE_MOST_S) -> None:
    """Every accepted job's status and run count from its record; for a submit that never got
    its answer, the job its Idempotency-Key (its token) made, if any.

    A job still queued or running once the traffic has stopped waiting may only be late (a
    backlog on a loaded machine, a message a sweep puts back): the records are read again
    while the stack still finishes some, until none is left, `stall` seconds pass in which
    none finished, or `most` in all. What is still not final then is lost: a lost job never
    finishes, so the count stops falling. A job whose record is gone cannot finish: it is not
    waited for."""
    client = stack.admin()
    wait_until(client.ping, 60, "Redis, to read the jobs back")
    tokens = [row["token"] for row in played.jobs if not row.get("id")]
    with client.pipeline(transaction=False) as pipe:
        for token in tokens:
            pipe.get(idempotency_key("", token))
        claims = pipe.execute()
    made = {t: c.split(" ", 1)[0] for t, c in zip(tokens, claims) if c}
    ids = [row["id"] for row in played.jobs if row.get("id")] + list(made.values())
    since = start = time.monotonic()
    records = dict(zip(ids, _records(client, ids)))
    left = _unfinished(records)
    while left and time.monotonic() - since < stall and time.monotonic() - start < most:
        time.sleep(2)
        records.update(zip(left, _records(client, left)))
        now_left = _unfinished(records)
        if len(now_left) < len(left):
            since = time.monotonic()
        left = now_left
    played.settled_s = time.monotonic() - start
    played.records = records
    played.unanswered = {t: {"id": job_id, **records[job_id]} for t, job_id in made.items()}


def _unfinished(records: dict[str, dict]) -> list[str]:
    return [job_id for job_id, r in records.items() if r["status"] in ("queued", "running")]


def _records(client: redis.Redis, ids: list[str]) -> list[dict]:
    with client.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hmget(f"{JOB_PREFIX}{job_id}", "status", "runs", "r")
        rows = pipe.execute()
    # A succeeded record keeps its runs third in `r` (tasks/lua/_compact.lua).
    return [{"status": status or "missing", "runs": int(runs or (packed or "0 0 0").split()[2])}
            for status, runs, packed in rows]
