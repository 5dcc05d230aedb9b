"""Trace ids follow a job through the API's and the worker's logs."""
from __future__ import annotations

import uuid

import requests


def test_one_trace_id_through_api_and_worker_logs(stack):
    trace_id = f"trace-{uuid.uuid4().hex[:12]}"
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "synthetic", "inputs": ["t"]},
                      headers={"X-Request-ID": trace_id}, timeout=10)
    job_id = r.json()["id"]
    assert stack.finished(job_id)["status"] == "succeeded"
    api_lines = [line for line in stack.web.log.read_text().splitlines() if job_id in line]
    worker_lines = [line for line in stack.workers["synth"].log.read_text().splitlines()
                    if job_id in line]
    assert any("accepted" in line for line in api_lines)
    assert {"received", "started", "succeeded"} <= {
        word for line in worker_lines for word in ("received", "started", "succeeded")
        if f"{job_id} {word}" in line}
    # Every line about the job, in both processes, carries its trace id.
    for line in api_lines + worker_lines:
        assert f"trace_id={trace_id}" in line, line
