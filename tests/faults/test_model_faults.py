"""Faults inside the model: a poison input, CUDA out-of-memory."""
from __future__ import annotations

import requests

from tests.faults.conftest import blocked


def test_poison_input_fails_only_its_own_job(faults):
    blocked(faults)  # the three posts below all wait in the buffer, however slow they are
    jobs = [faults.submit("sleepy", [x]) for x in ("ok", "!fail", "fine")]
    done = [faults.finished(j["id"]) for j in jobs]
    assert len({d["batch"]["id"] for d in done}) == 1, "the three jobs must share a batch"
    assert [d["status"] for d in done] == ["succeeded", "failed", "succeeded"]
    assert done[1]["error"]["code"] == "inference_error"
    assert done[0]["result"]["outputs"] == [2] and done[2]["result"]["outputs"] == [4]


def test_cuda_out_of_memory_halves_the_batch_before_failing_any_job(faults):
    # `oomy` raises CUDA's OutOfMemoryError for any call above 4 items; 16 inputs succeed
    # only if the worker keeps halving the chunk (16 → 8 → 4).
    body = faults.finished(faults.submit("oomy", [f"item{i:02d}" for i in range(16)])["id"])
    assert body["status"] == "succeeded"
    assert body["result"]["outputs"] == [6] * 16
    metrics = requests.get(faults.workers["faults"].extra["metrics_url"], timeout=5).text
    splits = [line for line in metrics.splitlines()
              if line.startswith('iq_oom_splits_total{model="oomy"}')]
    assert splits and float(splits[0].split()[-1]) >= 2
