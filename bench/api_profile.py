"""Exact call counts a request in one API process: a stack (Redis, one worker on the synthetic
model, the API as `gunicorn bench.profiled_wsgi:app`), the API's gunicorn worker under cProfile
switched on for the load's window only, `bench.load`'s clients (`Prefer: wait`) for
`--seconds`; prints the functions called most per job and those taking most own time (the
profiler inflates times; its counts are exact).
`python -m bench.api_profile --clients 64 --seconds 4 [--out FILE]`."""
from __future__ import annotations

import argparse
import os
import pstats
import tempfile
from pathlib import Path

import psutil
import requests
import yaml

from bench.harness import MODELS, run_load
from bench.profwrap import TOGGLE
from scripts.processes import VENV_BIN, Service, free_port, spawn, wait_until
from scripts.stack import start_redis, start_worker


def arguments() -> argparse.Namespace:
    """The call-count profilers' options (this one's and bench.intake_profile's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=60)
    return parser.parse_args()


def synthetic_stack(work: Path, **more: str) -> tuple[Service, dict[str, str]]:
    """A Redis in `work`, and the environment of a stack serving the synthetic model on it."""
    models_file = work / "models.yaml"
    models_file.write_text(yaml.safe_dump({"models": {"synthetic": MODELS["synthetic"]}}))
    redis_svc = start_redis(work)
    return redis_svc, dict(os.environ, REDIS_URL=redis_svc.extra["url"],
                           IQ_MODELS_FILE=str(models_file), HF_HUB_OFFLINE="1",
                           IQ_HEARTBEAT_INTERVAL_S="0.5", IQ_LOG_LEVEL="WARNING",
                           IQ_VAR_DIR=str(work), **more)


def main() -> None:
    args = arguments()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out = args.out or str(work / "api.prof")
        redis_svc, env = synthetic_stack(work, BENCH_PROFILE_OUT=out)
        services = [redis_svc]
        try:
            services.append(start_worker("intake", env, work, ["synthetic"]))
            port = free_port()
            web = spawn("web", [str(VENV_BIN / "gunicorn"), "--bind", f"127.0.0.1:{port}",
                                "bench.profiled_wsgi:app"], env, work)
            services.append(web)
            url = f"http://127.0.0.1:{port}"
            try:
                wait_until(lambda: requests.get(f"{url}/healthz", timeout=2).ok, 60, "the API")
            except TimeoutError:
                print(web.tail())
                raise
            (api,) = psutil.Process(web.proc.pid).children()
            run_load(url, "synthetic", args.clients, 1, 2, 0.5)  # warm-up
            os.kill(api.pid, TOGGLE)
            result = run_load(url, "synthetic", args.clients, 1, args.seconds, 0)
            os.kill(api.pid, TOGGLE)
            wait_until(lambda: os.path.exists(out) and os.path.getsize(out) > 0, 30, "profile")
        finally:
            for svc in reversed(services):
                svc.stop()
        report(pstats.Stats(out), result, args.top)


def report(stats: pstats.Stats, result: dict, top: int) -> None:
    jobs = result["jobs"]
    print(f"jobs {jobs}, {result['items_per_s']:.0f} items/s")
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append((nc / jobs, tt / jobs * 1e6, ct / jobs * 1e6,
                     f"{Path(file).parent.name}/{Path(file).name}:{line}({name})"))
    print(f"calls a job: {sum(r[0] for r in rows):.0f}; profiled time a job: "
          f"{sum(r[1] for r in rows):.1f} us (inflated by the profiler)")
    print("by calls a job:")
    for calls, tt, ct, where in sorted(rows, reverse=True)[:top]:
        print(f"{calls:8.2f} {tt:8.2f} {ct:8.2f}  {where}")
    print("by own time a job:")
    for calls, tt, ct, where in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"{calls:8.2f} {tt:8.2f} {ct:8.2f}  {where}")


if __name__ == "__main__":
    main()
