"""Redis's cost of a one-input job: commands per job by what each is for, and bytes a finished
job leaves in Redis, this checkout side by side with an earlier commit's.

    python -m bench.commands --model synthetic --clients 64 --baseline main \
        [--seconds 4 --rounds 3 --bytes-model minilm-embed --bytes-jobs 300]

Commands: every point's stack is up at once; rounds visit them in rotating order (as `python
-m bench` does) and count `INFO commandstats` deltas per finished job (commands run inside
scripts count, as Redis counts them). Then one more round per point runs under Redis's
MONITOR, which gives every command one purpose (bench/purposes.py), and its own commandstats
delta, so the breakdown can be checked against Redis's count; MONITOR costs Redis time, so
that round's throughput is not reported.

Bytes: on `--bytes-model` (minilm-embed, 384 float32 values an output, encoded the default
way), `--bytes-jobs` one-input jobs run to the end; `MEMORY USAGE` of every key holding a
job's id (its record, its stored result, ...) and the growth of every other key (indexes,
lists) shared out over the jobs, so that a job's share of an index is counted too. Redis's
`used_memory` growth per job is reported beside it.

Prints one JSON object and writes it to bench/results/commands.json (`--out`).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import redis
import requests

from bench import baseline
from bench.harness import HERE, MODELS, RESULTS, Config, Stack, start_stack
from bench.purposes import Monitor, Tally, script_names
from bench.usage import Usage
from scripts.stack import wait_until

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def configs(baseline_rev: str | None) -> list[Config]:
    """This checkout's service and, with `baseline_rev`, that commit's; both with one-request
    clients (`Prefer: wait`)."""
    out = [Config("service", flow="prefer-wait")]
    if baseline_rev:
        out.insert(0, Config(baseline_rev, tree=str(baseline.checkout(baseline_rev)),
                             flow="prefer-wait"))
    return out


def admin_client(stack: Stack) -> redis.Redis:
    extra = stack.services[0].extra
    return redis.Redis.from_url(extra.get("admin_url", extra["url"]), decode_responses=True)


def start_all(workdir: Path, model: str, points: list[Config], args,
              worker_name: str | None = None) -> list[Stack]:
    stacks = []
    try:
        for config in points:
            (workdir / config.slug).mkdir(parents=True, exist_ok=True)  # logs apart
            stacks.append(start_stack(workdir / config.slug, model, MODELS[model], config,
                                      args, worker_name))
        for stack in stacks:
            wait_until(lambda: requests.get(f"{stack.url}/readyz", timeout=2).status_code
                       == 200, 240, f"{stack.config.name} worker for {model}")
    except Exception:
        for stack in stacks:
            stack.stop()
        raise
    return stacks


def monitored_round(stack: Stack, model: str, clients: int, args) -> dict:
    """One round of load under MONITOR: commands per finished job by purpose, and Redis's own
    count (commandstats) of the same round beside it."""
    admin = admin_client(stack)
    tree = Path(stack.config.tree) if stack.config.tree else HERE.parent
    tally = Tally(script_names(tree))
    major = int(admin.info("server")["redis_version"].split(".")[0])
    usage = Usage()
    monitor = Monitor(stack.services[0].extra.get("admin_url", stack.services[0].extra["url"]))
    try:
        stack.load(model, clients, 1, args, usage, warmup=0.0)
    finally:
        lines = monitor.stop()
    tally.feed(lines, scripts_first=major < 7)
    out = tally.per_job(tally.jobs_finished)
    out["commandstats_total_per_job"] = round(
        sum(n for n in usage.commands.values() if n > 0) / max(tally.jobs_finished, 1), 2)
    return out


def commands_per_job(model: str, clients: int, points: list[Config], args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="iq-bench-commands-"))
    stacks = start_all(workdir, model, points, args)
    try:
        for stack in stacks:
            stack.load(model, clients, 1, args, duration=2.0, warmup=0.5)  # warm up
        usage = {s.config.name: Usage() for s in stacks}
        rounds: dict[str, list[float]] = defaultdict(list)
        for r in range(args.rounds):
            for stack in stacks[r % len(stacks):] + stacks[:r % len(stacks)]:
                result = stack.load(model, clients, 1, args, usage[stack.config.name])
                rounds[stack.config.name].append(round(result["jobs_per_s"], 1))
        out = {}
        for stack in stacks:
            report = usage[stack.config.name].report()
            out[stack.config.name] = {
                "jobs_per_s_rounds": rounds[stack.config.name],
                "commandstats_total_per_job": report["redis_commands_total_per_job"],
                "commandstats_per_job": report["redis_commands_per_job"],
                "monitored": monitored_round(stack, model, clients, args)}
        return out
    finally:
        for stack in stacks:
            stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _sizes(admin: redis.Redis) -> dict[str, int]:
    return {key: int(admin.memory_usage(key, samples=0) or 0)
            for key in admin.scan_iter(count=1000)}


def _run_jobs(url: str, model: str, count: int) -> list[str]:
    def one(i: int) -> str:
        body = requests.post(f"{url}/v1/jobs", json={
            "model": model, "inputs": [f"sentence number {i} for the memory bench"]},
            headers={"Prefer": "wait=30"}, timeout=60).json()
        while body["status"] not in ("succeeded", "failed"):
            body = requests.get(f"{url}/v1/jobs/{body['id']}", params={"wait": 30},
                                timeout=60).json()
        assert body["status"] == "succeeded", body
        return body["id"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def bytes_per_job(stack: Stack, model: str, count: int) -> dict:
    """What `count` finished one-input jobs leave in Redis, per job: every key named by a
    job's id (by kind), and its share of what every other key grew by."""
    admin = admin_client(stack)
    _run_jobs(stack.url, model, 20)  # the first jobs make keys every later one shares
    wait_until(lambda: admin.hlen("unacked") == 0, 10, "the warm-up jobs' acks")
    before, used_before = _sizes(admin), int(admin.info("memory")["used_memory"])
    ids = set(_run_jobs(stack.url, model, count))
    wait_until(lambda: admin.hlen("unacked") == 0, 10, "the jobs' acks")
    after, used_after = _sizes(admin), int(admin.info("memory")["used_memory"])
    own: Counter[str] = Counter()
    shared: Counter[str] = Counter()
    for key, size in after.items():
        found = _UUID.search(key)
        if found and found.group(0) in ids:
            own[key.replace(found.group(0), "<id>")] += size
        elif found is None and size != before.get(key, 0):
            shared[key] += size - before.get(key, 0)
    per_job = {k: round(v / count) for k, v in own.most_common()}
    shares = {k: round(v / count, 1) for k, v in shared.most_common() if abs(v) >= count}
    return {"jobs": count, "bytes_per_job": round((sum(own.values()) + sum(shared.values()))
                                                  / count),
            "keys_per_job": per_job, "shared_keys_growth_per_job": shares,
            "used_memory_growth_per_job": round((used_after - used_before) / count)}


def bytes_side_by_side(model: str, count: int, points: list[Config], args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="iq-bench-bytes-"))
    # Named as `make run` names its worker: the record keeps the name of the one that ran it.
    stacks = start_all(workdir, model, points, args, worker_name="worker")
    try:
        return {stack.config.name: bytes_per_job(stack, model, count) for stack in stacks}
    finally:
        for stack in stacks:
            stack.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic", choices=sorted(MODELS))
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=4.0, help="seconds per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", metavar="COMMIT", default=None)
    p.add_argument("--bytes-model", default="minilm-embed", choices=sorted(MODELS))
    p.add_argument("--bytes-jobs", type=int, default=300, help="0: no bytes measurement")
    p.add_argument("--no-commands", action="store_true", help="bytes only")
    p.add_argument("--out", type=Path, default=RESULTS / "commands.json")
    a = p.parse_args()
    args = SimpleNamespace(clients=[a.clients], duration=a.seconds, warmup=1.0,
                           rounds=a.rounds, flow="prefer-wait")
    points = configs(a.baseline)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = {"started": started, "command": " ".join(["python -m bench.commands", *sys.argv[1:]]),
           "model": a.model, "clients": a.clients, "rounds": a.rounds,
           "seconds_per_round": a.seconds}
    if not a.no_commands:
        out["commands"] = commands_per_job(a.model, a.clients, points, args)
    if a.bytes_jobs:
        out["bytes"] = {"model": a.bytes_model, **bytes_side_by_side(
            a.bytes_model, a.bytes_jobs, points, args)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
