"""Exact call counts a job in the worker's main process: a stack (Redis, one worker on the
synthetic model, the API), the worker's main process under cProfile (bench/profwrap.py)
switched on for the load's window only, `bench.load`'s clients for `--seconds`; prints the
functions called most per job and those taking most time (the profiler inflates times; its
counts are exact). `python -m bench.intake_profile --clients 64 --seconds 4 [--out FILE]`."""
from __future__ import annotations

import os
import pstats
import sys
import tempfile
from pathlib import Path

from bench.api_profile import arguments, report, synthetic_stack
from bench.harness import run_load
from bench.profwrap import TOGGLE
from scripts.processes import wait_until
from scripts.stack import start_web, start_worker


def main() -> None:
    args = arguments()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out = args.out or str(work / "worker-main.prof")
        redis_svc, env = synthetic_stack(work)
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
        report(pstats.Stats(out), result, args.top)


if __name__ == "__main__":
    main()
