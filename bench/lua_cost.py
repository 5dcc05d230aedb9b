"""Redis's time a one-input job in each move of its way, the moves alone, without the API or a
worker: on a private Redis (as `make run` starts one), batches of `--batch` jobs are submitted
together (one SUBMIT_MANY, as an API process's group commit sends them), fetched (FETCH), started
(START), finished with a reply channel each (FINISH, as for `Prefer: wait`) and acknowledged
(HDEL), through the same Python (tasks/jobstate.py, workers/broker/) that the services run. Per
move: Redis's microseconds a job by `INFO commandstats` (a script's own time includes the
commands it ran), its commands a job, and its round trips a batch.

    python -m bench.lua_cost [--batch 16] [--batches 200] [--rounds 3] [--callgrind BATCHES]

A quick, quiet figure for a change to a script: the services' own cost (bench.cpu) varies
with the machine's load far more than this does. Prints one JSON object. With `--callgrind`,
Redis's instructions a job by move instead, which no load moves (bench/lua_instructions.py)."""
from __future__ import annotations

import argparse
import inspect
import json
import shutil
import sys
import tempfile
import uuid
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import redis
from celery import Celery

from tasks import results
from tasks.jobstate import Final, JobState, Status, new_job
from tasks.keys import REPLY_PREFIX
from tasks.messages import JOB_TOKEN_HEADER, task_message
from tasks.names import PRIORITIES, queue_lists
from workers.broker import lua as broker_lua
from workers.broker.inflight import InFlight, fetch_call, fetched

QUEUE = "synthetic"
MOVES = ("submit", "fetch", "start", "finish", "ack")


class _Collect:
    """Stands in for an API process's group commit: the submit calls, kept to go together."""

    def __init__(self) -> None:
        self.calls: list = []

    def submit(self, call: Any) -> list[str]:
        self.calls.append(call)
        return ["created", call[1][0]]


def _stats(admin: redis.Redis) -> tuple[Counter, Counter]:
    stats = admin.info("commandstats").items()
    return (Counter({k.removeprefix("cmdstat_"): v["calls"] for k, v in stats}),
            Counter({k.removeprefix("cmdstat_"): v["usec"] for k, v in stats}))


class Moves:
    """One batch's way through Redis, move by move, each measured."""

    def __init__(self, client: redis.Redis, admin: redis.Redis, batch: int) -> None:
        self.client, self.admin, self.batch = client, admin, batch
        self.app = Celery("lua-cost", set_as_current=False)
        self.state = JobState(client, keep_s=3600, ttl_s=86_400)
        self.broker = SimpleNamespace(inflight_key=broker_lua.INFLIGHT_PREFIX + "bench",
                                      alive_key=broker_lua.ALIVE_PREFIX + "bench")
        self.inflight = InFlight(client, self.broker)
        self.calls: dict[str, Counter] = {m: Counter() for m in MOVES}
        self.usec: dict[str, Counter] = {m: Counter() for m in MOVES}
        self.trips: Counter = Counter()
        self.jobs = 0

    def _measured(self, move: str, trips: int, fn: Any) -> Any:
        calls, usec = _stats(self.admin)
        out = fn()
        calls2, usec2 = _stats(self.admin)
        self.calls[move].update(calls2 - calls)
        self.usec[move].update(usec2 - usec)
        self.calls[move]["info"] -= 1
        self.trips[move] += trips
        return out

    def one_batch(self) -> None:
        self.client.set(self.broker.alive_key, "1", px=600_000)
        collect, jobs = _Collect(), []
        self.state._grouped = collect
        for _ in range(self.batch):
            job = new_job(str(uuid.uuid4()), model="synthetic", trace_id=uuid.uuid4().hex,
                          inputs=1, priority="normal", token=uuid.uuid4().hex[:8])
            body = {"inputs": [[0.5] * 8], "options": {}}
            message = task_message(self.app, "iq.synthetic", job.id, body, queue=QUEUE,
                                   priority=PRIORITIES["normal"],
                                   headers={"trace_id": job.trace_id,
                                            JOB_TOKEN_HEADER: job.token})
            request = json.dumps(body).encode()
            self.state.submit(job, message, depth_lists=queue_lists(QUEUE), max_depth=None,
                              ttl_s=86_400, memory_headroom=0.1, request=request,
                              size=len(request), reply=REPLY_PREFIX + "bench")
            jobs.append(job)
        self.state._grouped = None
        self._measured("submit", 1, lambda: self.state._submit_many(collect.calls))
        keys, args = fetch_call(self.broker, queue_lists(QUEUE), self.batch)
        got = self._measured("fetch", 1, lambda: fetched(
            self.inflight._fetch(keys=keys, args=args)))
        tags = [json.loads(raw)["properties"]["delivery_tag"] for _l, raw in got]
        ids = [job.id for job in jobs]
        self._measured("start", 1, lambda: self.state.start(
            ids, worker="bench/1", batch=f"{uuid.uuid4().hex[:12]} {len(ids)} {len(ids)}",
            tokens=[job.token for job in jobs], held=(self.broker.inflight_key, tags)))
        finals = [Final(job.id, Status.SUCCEEDED, results.stored(job.id, outputs=[[0.25] * 8]),
                        token=job.token) for job in jobs]
        joined = "held" in inspect.signature(self.state.finish).parameters
        held = {"held": (self.broker.inflight_key, tags)} if joined else {}
        self._measured("finish", 1, lambda: self.state.finish(finals, result_ttl_s=3600,
                                                              model_version="1", **held))
        if not joined:  # a tree whose finish does not acknowledge: the worker's HDEL
            self._measured("ack", 1, lambda: self.inflight.ack(tags))
        self.jobs += len(jobs)

    def report(self) -> dict:
        jobs = max(self.jobs, 1)
        batches = jobs / self.batch
        out: dict = {"jobs": self.jobs, "batch": self.batch, "moves": {}}
        for move in MOVES:
            calls, usec = self.calls[move], self.usec[move]
            top = usec["evalsha"] + sum(us for name, us in usec.items() if name != "evalsha"
                                        and calls["evalsha"] == 0)
            out["moves"][move] = {
                "usec_per_job": round(top / jobs, 2),
                "commands_per_job": round(sum(n for n in calls.values() if n > 0) / jobs, 2),
                "round_trips_per_batch": round(self.trips[move] / batches, 2),
                "by_command_usec_per_job": {k: round(v / jobs, 2)
                                            for k, v in usec.most_common() if v > 0},
            }
        out["usec_per_job"] = round(sum(m["usec_per_job"] for m in out["moves"].values()), 2)
        out["commands_per_job"] = round(sum(m["commands_per_job"]
                                            for m in out["moves"].values()), 2)
        out["round_trips_per_batch"] = round(sum(m["round_trips_per_batch"]
                                                 for m in out["moves"].values()), 2)
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--redis-arg", action="append", default=[], metavar="OPTION",
                   help="one more redis-server option for the private Redis, e.g. "
                        "'--hash-max-ziplist-value 1024' (repeat for more)")
    p.add_argument("--callgrind", type=int, default=0, metavar="BATCHES",
                   help="count Redis's instructions a job by move over this many batches, "
                        "under valgrind's callgrind, instead of timing them")
    a = p.parse_args()
    if a.callgrind:
        from bench.lua_instructions import instructions

        print(json.dumps(instructions(a.batch, a.callgrind, Moves), indent=2))
        return 0
    from scripts.redis_nodes import start_redis

    workdir = Path(tempfile.mkdtemp(prefix="iq-lua-cost-"))
    svc = start_redis(workdir, args=[w for arg in a.redis_arg for w in arg.split()])
    try:
        client = redis.Redis.from_url(svc.extra["url"])
        admin = redis.Redis.from_url(svc.extra["admin_url"], decode_responses=True)
        rounds = []
        for _ in range(a.rounds):
            admin.flushall()
            moves = Moves(client, admin, a.batch)
            moves.one_batch()  # scripts loaded, connections made
            moves = Moves(client, admin, a.batch)
            cpu = psutil.Process(svc.proc.pid).cpu_times()
            for _ in range(a.batches):
                moves.one_batch()
            after = psutil.Process(svc.proc.pid).cpu_times()
            report = moves.report()
            report["redis_cpu_usec_per_job"] = round(
                1e6 * (after.user + after.system - cpu.user - cpu.system) / moves.jobs, 1)
            rounds.append(report)
        best = min(rounds, key=lambda r: r["usec_per_job"])
        print(json.dumps({"redis": admin.info("server")["redis_version"],
                          "usec_per_job_by_round": [r["usec_per_job"] for r in rounds],
                          "best": best}, indent=2))
    finally:
        svc.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
