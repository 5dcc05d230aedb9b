"""Exact call counts a job in the worker's main process: a stack (Redis, one worker on the
synthetic model, the API), the worker's main process under cProfile (bench/profwrap.py)
switched on for the load's window only, `bench.load`'s clients for `--seconds`; prints the
functions called most per job and those taking most time (the profiler inflates times; its
counts are exact). `python -m bench.intake_profile --clients 64 --seconds 4 [--out FILE]`."""
from __future__ import annotations

import argparse
import os
import pstats
import signal
import sys
import tempfile
from pathlib import Path

import yaml

from bench.harness import MODELS, run_load
from bench.profwrap import TOGGLE
from scripts.processes import wait_until
from scripts.stack import VENV_BIN, start_redis, start_web, start_worker


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out = args.out or str(work / "worker-main.prof")
        models_file = work / "models.yaml"
        models_file.write_text(yaml.safe_dump({"models": {"synthetic": MODELS["synthetic"]}}))
        redis_svc = start_redis(work)
        env = dict(os.environ, REDIS_URL=redis_svc.extra["url"], IQ_MODELS_FILE=str(models_file),
                   HF_HUB_OFFLINE="1", IQ_HEARTBEAT_INTERVAL_S="0.5", IQ_LOG_LEVEL="WARNING",
                   IQ_VAR_DIR=str(work))
        services = [redis_svc]
        try:
            worker = start_worker("intake", env, work, ["synthetic"],
                                  wrap=[sys.executable, "-m", "bench.profwrap", out])
            services.append(worker)
            web = start_web(env, work)
            services.append(web)
            run_load(web.extra["url"], "synthetic", args.clients, 1, 2, 0.5)  # warm-up
            os.kill(worker.proc.pid, TOGGLE)
            result = run_load(web.extra["url"], "synthetic", args.clients, 1, args.seconds, 0)
            os.kill(worker.proc.pid, TOGGLE)
            wait_until(lambda: os.path.exists(out) and os.path.getsize(out) > 0, 30, "profile")
        finally:
            for svc in reversed(services):
                svc.stop()
        jobs = result["jobs"]
        print(f"jobs {jobs}, {result['items_per_s']:.0f} items/s")
        stats = pstats.Stats(out)
        rows = []
        for (file, line, name), (cc, nc, tt, ct, _callers) in stats.stats.items():
            rows.append((nc / jobs, tt / jobs * 1e6, ct / jobs * 1e6,
                         f"{Path(file).name}:{line}({name})"))
        total = sum(r[1] for r in rows)
        print(f"profiled time a job: {total:.1f} us (inflated by the profiler)")
        print("by calls a job:")
        for calls, tt, ct, where in sorted(rows, reverse=True)[:args.top]:
            print(f"{calls:8.2f} {tt:8.2f} {ct:8.2f}  {where}")
        print("by own time a job:")
        for calls, tt, ct, where in sorted(rows, key=lambda r: -r[1])[:args.top]:
            print(f"{calls:8.2f} {tt:8.2f} {ct:8.2f}  {where}")


if __name__ == "__main__":
    main()
