"""How many API processes, worker main processes and Redis groups a host needs for a rate of
one-input jobs (issue 40's capacity model), from a `bench.cpu` result: each process is
single-threaded and planned at 70 % of a core.

The per-job costs come from this machine; a GPU host's cores do less a job. The scale to the
16-core H200 host is one measured pair: the same code (main after issue 30) run by `bench.cpu`
here (results/i30/cpu-synthetic-64.json, point `service`) and there (results/gpu/
cpu-synthetic-64.json, point `service`). Each process's cost on that host is projected as its
cost here times that pair's ratio; not measured there.

    python -m bench.capacity bench/results/session/cpu-64-final.json --point service \
        --out bench/results/session/capacity.json
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parent
HERE_REF = BENCH / "results/i30/cpu-synthetic-64.json"
GPU_HOST_REF = BENCH / "results/gpu/cpu-synthetic-64.json"
PARTS = {"api": "api", "worker_main": "worker main", "redis": "redis",
         "child": "worker child"}
BUSY = 0.7
RATES = (10_000, 50_000)


def costs(path: Path, point: str) -> dict[str, float]:
    """ms of CPU a one-input job, by part, of `point` in a bench.cpu result file."""
    measured = json.loads(path.read_text())["points"][point]["cpu_ms_per_job"]
    return {part: measured[name] for part, name in PARTS.items()}


def _enough(x: float) -> int:
    """The whole number of processes that carry `x` (a float product that should be whole)."""
    return math.ceil(round(x, 6))


def plan(ms: dict[str, float], rate: int) -> dict:
    """Processes of each kind for `rate` jobs/s, each at BUSY of a core."""
    per_process = {part: BUSY * 1000 / ms[part] for part in ("api", "worker_main", "redis")}
    return {"jobs_per_s": rate,
            "per_process_jobs_per_s_at_70pct": {k: round(v) for k, v in per_process.items()},
            "api_processes": _enough(rate / per_process["api"]),
            "worker_main_processes": _enough(rate / per_process["worker_main"]),
            "redis_groups": _enough(rate / per_process["redis"]),
            "cores_for_children_outside_the_model": _enough(rate * ms["child"] / 1000 / BUSY)}


def model(path: Path, point: str) -> dict:
    here = costs(path, point)
    scale = {part: costs(GPU_HOST_REF, "service")[part] / costs(HERE_REF, "service")[part]
             for part in PARTS}
    gpu_host = {part: round(here[part] * scale[part], 3) for part in PARTS}
    return {"source": {"bench_cpu": str(path), "point": point,
                       "scale_pair": [str(HERE_REF), str(GPU_HOST_REF)]},
            "ms_per_job_here": here, "gpu_host_over_here": {k: round(v, 2) for k, v in scale.items()},
            "ms_per_job_gpu_host_projected": gpu_host, "busy": BUSY,
            "plans": {"gpu_host_cores": {str(r): plan(gpu_host, r) for r in RATES},
                      "this_machines_cores": {str(r): plan(here, r) for r in RATES}}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", type=Path, help="a bench.cpu result (JSON)")
    p.add_argument("--point", default="service", help="which point of it (default: service)")
    p.add_argument("--out", type=Path, help="write the model here as JSON")
    args = p.parse_args()
    result = model(args.result, args.point)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    for where, plans in result["plans"].items():
        for rate, row in plans.items():
            print(f"{where} {rate:>6} jobs/s: {row['api_processes']} API, "
                  f"{row['worker_main_processes']} worker main, {row['redis_groups']} Redis groups, "
                  f"{row['cores_for_children_outside_the_model']} cores for children")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
