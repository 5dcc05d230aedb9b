"""The device's busy share on a real worker: the GPU-faithful stand-in's calls counted as the
device's time, the gaps between them while jobs waited as its idle time, their ratio on the
worker's /metrics; and the stand-in's vectors stored packed and read back."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests

from scripts.stack import launch

CALL_S = 0.1


def _sample(text: str, name: str, **labels) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{")
               and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_the_busy_share_counts_the_device_idle_only_while_jobs_waited(tmp_path):
    # One job a call, so that the jobs queued behind the first wait through every gap in
    # which the child stores, reports and starts the next (and prepares its input).
    models = {"gpu": {"kind": "synthetic", "base_ms": 1000 * CALL_S, "per_item_ms": 0,
                      "prepare_ms": 2, "output_floats": 8, "max_batch_size": 1}}
    stack = launch(tmp_path, models, {"w": ["gpu"]})
    try:
        inputs = [f"job-{i}" + "x" * i for i in range(6)]
        with ThreadPoolExecutor(len(inputs)) as pool:
            jobs = list(pool.map(lambda text: stack.submit("gpu", [text]), inputs))
        done = [stack.finished(job["id"]) for job in jobs]
        assert [d["status"] for d in done] == ["succeeded"] * len(inputs)
        for text, body in zip(inputs, done):
            (vector,) = body["result"]["outputs"]
            assert len(vector) == 8 and vector[0] == len(text) and vector[1] == len(text) / 2
        text = requests.get(stack.workers["w"].extra["metrics_url"], timeout=5).text
        busy = _sample(text, "iq_device_busy_seconds_total", model="gpu", device="cpu")
        idle = _sample(text, "iq_device_idle_waiting_seconds_total", model="gpu", device="cpu")
        share = _sample(text, "iq_device_busy_share", model="gpu", device="cpu")
        assert busy >= len(inputs) * CALL_S * 0.99, text
        # Each of the five gaps while jobs waited held at least the next job's preparation.
        assert idle >= 5 * 0.002, (busy, idle)
        assert 0 < share < 1 and abs(share - busy / (busy + idle)) < 0.01, (share, busy, idle)
    finally:
        stack.stop()
