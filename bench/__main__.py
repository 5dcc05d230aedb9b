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
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import psutil
import requests
import yaml

from bench.harness import (FLOWS, HERE, MODELS, RESULTS, Config, JobsNotFinished, RawServer,
                           Stack, api_processes, configs_for, pool, pool_raw, run_load,
                           start_stack, stop_all)
from bench.report import evaluate_targets, plot, render_readme
from bench.usage import Usage
from scripts.stack import wait_until


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


def raw_beside(clients: int, inputs: int, max_batch_size: int) -> tuple[str, int] | None:
    """The raw model batch a point's targets compare it with, measured in the point's own
    rounds: batch 1 beside the lone job, batch 16 beside 16 one-input clients, the largest
    batch beside the 32-input jobs."""
    if inputs > 1:
        return "multi", max_batch_size
    if clients in (1, 16):
        return ("lone" if clients == 1 else "16 clients"), min(clients, max_batch_size)
    return None


def start_stacks(stacks: list[Stack], workdir: Path, model: str, spec: dict,
                 configs: list[Config], args) -> None:
    """Every configuration's stack, added to `stacks` once started (so that the caller stops
    those that did start should another fail), then each waited for until it is ready."""
    # Started side by side: each mostly waits on its processes' imports and first beats.
    with ThreadPoolExecutor(len(configs)) as starting:
        started = [starting.submit(start_stack, workdir, model, spec, config, args)
                   for config in configs]
    stacks += [f.result() for f in started if f.exception() is None]
    for f in started:
        f.result()  # the first failure, once the stacks that did start are in `stacks`
    for stack in stacks:
        wait_until(lambda: requests.get(f"{stack.url}/readyz", timeout=2).status_code
                   == 200, 180, f"{stack.config.name} worker for {model}")


def measure_point(model: str, stacks: list[Stack], raw: RawServer, clients: int, inputs: int,
                  args, results: dict[str, dict], side_by_side: dict[str, dict]) -> None:
    """One point (`clients` clients, `inputs` inputs a job) in rounds that visit the
    configurations, and the raw model where a target compares against it, in a rotating
    order. Each configuration's pooled point goes into `results` (its sweep, or its multi
    point), the raw model's into `side_by_side`."""
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
                rounds[name].append(stack.load(model, clients, inputs, args, usage[name]))
    label = f"{clients:3} clients" if inputs == 1 else "32-input jobs"
    for stack in stacks:
        name = stack.config.name
        point = {**pool(rounds[name]), **usage[name].report()}
        print(f"  {model:13} {name:21} {label}: "
              f"{point['items_per_s']:8.1f} items/s  p50 {point['p50_ms']:7.1f} ms  "
              f"p99 {point['p99_ms']:7.1f} ms  queue-path CPU "
              f"{point['queue_path_cpu_ms_per_job']:.2f} ms/job  "
              f"device busy {_share(point['device_busy_share'])} "
              f"(of wall {_share(point['device_busy_of_wall'])})  rounds {point['rounds_items_per_s']}", flush=True)
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


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.2f}"


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
        start_stacks(stacks, workdir, model, spec, configs, args)
        results: dict[str, dict] = {s.config.name: {"config": asdict(s.config), "sweep": []}
                                    for s in stacks}
        points = [(clients, 1) for clients in args.clients] + [(args.multi_clients, 32)]
        for clients, inputs in points:
            measure_point(model, stacks, raw, clients, inputs, args, results, side_by_side)
        service = next((s for s in stacks if s.config.name == "service"), None)
        if args.rss_jobs and service and model == "synthetic":
            rss = rss_growth(service.url, model, service.web_pid, args.rss_jobs, 32)
            results["service"]["rss"] = rss
            print(f"  API RSS growth over {rss['jobs']} jobs: {rss['growth_mb']:.1f} MB",
                  flush=True)
        return results, side_by_side
    finally:
        stop_all(stacks)


def parse_args() -> argparse.Namespace:
    """The command line, with the settings of a full or a quick (`--quick`) run filled in
    where it leaves them out."""
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
        a.clients, a.duration, a.warmup, a.multi_clients, a.rounds = [1, 4], 0.5, 0.25, 2, 1
        a.raw_seconds, a.rss_jobs = 0.2, 0
        a.models = a.models or ["synthetic"]
        a.configs = a.configs or ["service", "no-batching", "celery-batches"]
    else:
        a.clients, a.duration, a.warmup, a.multi_clients = [1, 4, 16, 64], 4.0, 1.0, 8
        a.rounds, a.raw_seconds, a.rss_jobs = 3, 2.0, 0 if a.no_rss else 20_000
    a.clients = clients or a.clients
    a.duration = duration or a.duration
    a.rounds = rounds or a.rounds
    return a


def new_report(a: argparse.Namespace, name: str) -> dict:
    """The report's header: the run's name, command, method and machine; no models yet."""
    return {
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


def bench_one(workdir: Path, model: str, a: argparse.Namespace) -> dict:
    """One model: the raw model's ceiling, then every chosen configuration beside it. Raises
    JobsNotFinished when a configuration's jobs do not finish."""
    spec = MODELS[model]
    models_file = workdir / f"{model}.yaml"
    models_file.write_text(yaml.safe_dump({"models": {model: spec}}))
    configs = [replace(c, flow=c.flow or a.flow) for c in configs_for(spec, a.baseline)
               if (not a.configs and not c.unix_socket) or c.name in a.configs or c.tree]
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
    return {"spec": spec, "raw": ceiling, "configs": configs_result}


def main() -> int:
    a = parse_args()
    # A SIGTERM or a hang-up ends the run through its `finally`s, which stop every stack.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    name = a.name or ("quick" if a.quick else "latest")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    workdir = Path(tempfile.mkdtemp(prefix="iq-bench-"))
    report = new_report(a, name)
    try:
        for model in a.models or list(MODELS):
            report["models"][model] = bench_one(workdir, model, a)
    except JobsNotFinished as exc:
        print(f"bench: jobs do not finish, stopping: {exc}", file=sys.stderr)
        return 1
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
