"""Game day: `make gameday` (or `python -m bench.gameday`).

Starts the stack `make run` starts (bench/gameday/stack.py), on free ports with a var dir of
its own, measures its capacity, then sends open-loop traffic at a share of it for
`--minutes` while a fault strikes every `--every` seconds, and reports availability, latency
per minute and per fault window, recovery, lost and twice-run jobs and 5xx answers against
the targets: bench/results/<name>.json and .png, and a table here. Exit status 1 when a target
was missed (the table says which fault), 0 when all were met.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from functools import reduce
from operator import or_
from pathlib import Path

import yaml

from bench.gameday.faults import FAULTS, Fault
from bench.gameday.ledger import analyse, jobs_of
from bench.gameday.play import DRAIN_S, Played, capacity, play
from bench.gameday.report import picture, render_readme, table
from bench.gameday.stack import Needs, Stack
from config import ConfigError, Settings
from config.models import parse_models, read_models_content
from scripts import hosts
from scripts.preflight import Refused
from scripts.run import ROOT

RESULTS = ROOT / "bench" / "results"
# A model's entries that config/models.py resolves from the models file's folder.
PATH_KEYS = ("path", "runs_log", "load_gate")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gameday",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="minutes of traffic (longer if the last fault needs it)")
    parser.add_argument("--rate", type=float,
                        help="arrivals per second (default: --share of the measured capacity)")
    parser.add_argument("--share", type=float, default=0.5,
                        help="share of the measured capacity to send (default 0.5)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, in order; known: {', '.join(FAULTS)}")
    parser.add_argument("--every", type=float, default=60.0, help="seconds between faults")
    parser.add_argument("--drain", type=float, default=DRAIN_S,
                        help="seconds after the last arrival for jobs to finish")
    parser.add_argument("--model", default="minilm-embed")
    parser.add_argument("--models-file", type=Path,
                        help="the stack's models file (IQ_MODELS_FILE; default make run's)")
    parser.add_argument("--name", help="results' name (default gameday-<UTC time>)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go")
    parser.add_argument("--var", type=Path, help="the stack's var dir: secrets, Redis's data, "
                        "logs, the jobs (default var/gameday/<name>)")
    args = parser.parse_args(argv)
    if args.models_file is not None and not args.models_file.is_file():
        parser.error(f"--models-file {args.models_file}: no such file")
    unknown = [f for f in args.faults.split(",") if f and f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    try:
        args.model_entry = model_entry(args.models_file or Path(Settings.models_file),
                                       args.model, "model-reload" in args.faults.split(","))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def model_entry(models_file: Path, model: str, copied: bool) -> dict:
    """The model's entry in the models file, as written there (the report keeps it); a
    ValueError when the file is refused, lacks the model, or is to be copied (the reload's
    copy in the var dir) with a relative path in it, which the copy would resolve elsewhere."""
    try:
        content = read_models_content(models_file)
        specs = parse_models(models_file, content)
    except ConfigError as exc:
        raise ValueError(f"--models-file {models_file}: {exc}") from None
    if model not in specs:
        raise ValueError(f"--model {model} is not in {models_file} (it has "
                         f"{', '.join(sorted(specs))}): the traffic would find no worker")
    raw = yaml.safe_load(content)["models"]  # the same bytes as parsed, as written
    relative = [f"{name}.{key}" for name, entry in raw.items() for key in PATH_KEYS
                if isinstance(entry, dict) and entry.get(key)
                and not Path(str(entry[key])).expanduser().is_absolute()]
    if copied and relative:
        raise ValueError(f"--models-file {models_file}: model-reload runs on a copy in the "
                         f"run's var dir, where {', '.join(relative)} would point elsewhere: "
                         f"give absolute paths")
    return raw[model]


def describe(played: Played, model: str, started: str, source: str,
             load: tuple[float, float, float]) -> dict:
    return {"started": started, "model": model, "rate": played.rate, "rate_source": source,
            "seconds": played.end - played.start, "load_before": [round(x, 2) for x in load],
            "machine": f"{platform.platform()}, Python {platform.python_version()}"}


def run(args: argparse.Namespace, faults: list[type[Fault]]) -> dict:
    """Start the stack, play the game day, stop the stack, and write and print the report."""
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    load = os.getloadavg()  # the machine before the stack adds to it
    print(f"gameday: load average before the start {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} ({os.cpu_count()} cores)", flush=True)
    name = args.name or f"gameday-{started.replace(':', '').replace('-', '')}"
    var = args.var or ROOT / "var" / "gameday" / name
    var.mkdir(parents=True, exist_ok=True)
    needs = reduce(or_, (f.needs for f in faults), Needs())
    if needs.own_host and (why := hosts.unavailable()):
        raise SystemExit(f"gameday: host-cut needs a host of its own, which this machine "
                         f"cannot make: {why}")
    print(f"gameday: starting the stack in {var} (logs in {var / 'logs'}); beyond make run's "
          f"defaults: {needs}", flush=True)
    with ExitStack() as context:
        host = context.enter_context(hosts.hosts(1))[0] if needs.own_host else None
        try:
            stack = Stack(var, needs=needs, host=host, models_file=args.models_file)
        except Refused as exc:  # what make run would refuse: its var dir, a port, a setting
            raise SystemExit(f"gameday: {exc}") from None
        if stack.cpu_threads is not None:
            print(f"gameday: {len(stack.workers)} workers ({', '.join(stack.workers)}) share "
                  f"this machine's {os.cpu_count()} cores: IQ_CPU_THREADS={stack.cpu_threads} "
                  f"for each", flush=True)
        played, source = _play(args, faults, stack)
    own = {"models_file": str(args.models_file.resolve())} if args.models_file else {}
    report = {"run": describe(played, args.model, started, source, load) | own
              | {"model_entry": args.model_entry, "var": str(var)},
              **analyse(played)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    picture(report, [(j.at, j.ms) for j in jobs_of(played)], args.out / f"{name}.png")
    if args.out == RESULTS:
        render_readme(report, RESULTS.parent / "README.md", f"results/{name}.png")
    print(table(report))
    print(f"\nwrote {args.out / name}.json and .png; jobs and logs in {var}", flush=True)
    return report


def _play(args: argparse.Namespace, faults: list[type[Fault]],
          stack: Stack) -> tuple[Played, str]:
    """Start `stack`, measure its capacity (unless `--rate`), play the game day, stop it."""
    try:
        stack.start()
        if args.rate:
            rate, source = args.rate, "given"
        else:
            measured = capacity(stack, args.model)
            if not measured["jobs"]:
                raise SystemExit(f"gameday: the stack completed no job in the capacity "
                                 f"measurement ({measured}); give a --rate")
            rate = args.share * measured["jobs_per_s"]
            source = f"{args.share:.0%} of {measured['jobs_per_s']:.1f} measured"
        print(f"gameday: {rate:.1f} jobs/s ({source})", flush=True)
        return play(stack, args.model, faults, rate, args.minutes * 60, every=args.every,
                    drain=args.drain, out=stack.var / "jobs.jsonl"), source
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    # A SIGTERM (a CI's timeout, a kill) stops the run as Ctrl-C does: the stack and the
    # traffic are stopped on the way out, not left running in their own sessions.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args, [FAULTS[f] for f in args.faults.split(",") if f])
    return 0 if all(t["pass"] for t in report["targets"]) else 1


if __name__ == "__main__":
    t = time.monotonic()
    code = main()
    print(f"gameday: {time.monotonic() - t:.0f} s in all")
    sys.exit(code)
