"""Trace ids follow a job through the API's and the worker's logs."""
from __future__ import annotations

import uuid

import requests

from scripts.stack import wait_until
from tests.support.records import fields


def test_one_trace_id_through_api_and_worker_logs(stack):
    trace_id = f"trace-{uuid.uuid4().hex[:12]}"
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "synthetic", "inputs": ["t"]},
                      headers={"X-Request-ID": trace_id}, timeout=10)
    job_id = r.json()["id"]
    assert r.headers["X-Request-ID"] == trace_id
    done = stack.finished(job_id)
    assert done["status"] == "succeeded" and done["trace_id"] == trace_id
    # At INFO the worker writes one line a batch, naming each job with its trace id (a line
    # a job is DEBUG): grep either id to find the batch that ran it. The line follows the
    # job's result (it is written once the batch is settled), so it may come a moment later.
    def worker_lines() -> list[str]:
        return [line for line in stack.workers["synth"].log.read_text().splitlines()
                if job_id in line]

    wait_until(worker_lines, 30, "the worker's line for the batch that ran the job")
    [line] = worker_lines()
    assert f"batch {done['batch']['id']} of synthetic" in line
    assert f"{job_id} succeeded trace_id={trace_id}" in line


def _sample(text: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include `labels` (all children together)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_worker_metrics_are_summed_across_prefork_children(tmp_path):
    from scripts.stack import launch

    models = {"syn2": {"kind": "synthetic", "base_ms": 50, "per_item_ms": 0,
                       "max_batch_size": 4, "max_inputs": 10}}
    stack = launch(tmp_path, models, {}, ready_models=[])
    try:
        from scripts.stack import start_worker, wait_until

        stack.workers["two"] = start_worker("two", stack.env, tmp_path, ["syn2"],
                                            concurrency=2)
        wait_until(lambda: requests.get(f"{stack.api}/v1/models", timeout=2).json()
                   ["models"][0]["instances"] == 2, 120, "two children")
        # A job of 10 inputs runs alone, as three model calls (4, 4 and 2 items); the failing
        # job runs last, alone, as a call that raised.
        jobs = [stack.submit("syn2", ["a", "bb"]) for _ in range(12)] + \
            [stack.submit("syn2", list("abcdefghij"))]
        done = [stack.finished(j["id"]) for j in jobs]
        jobs.append(stack.submit("syn2", ["!fail"]))
        done.append(stack.finished(jobs[-1]["id"]))
        children = {fields(stack.redis, j['id']).get("worker") for j in jobs}
        assert len(children) == 2, "both children must have run jobs"
        text = requests.get(stack.workers["two"].extra["metrics_url"], timeout=5).text
        assert _sample(text, "iq_jobs_total", model="syn2", outcome="succeeded") == 13
        assert _sample(text, "iq_jobs_total", model="syn2", outcome="failed") == 1
        assert _sample(text, "iq_items_total", model="syn2", outcome="succeeded") == 34
        batches = {d["batch"]["id"] for d in done}
        # iq_batch_size observes each model call that returned (the 10-input job's batch made
        # three, of at most max_batch_size items; the failing job's none); iq_batch_jobs each
        # dispatched batch.
        assert _sample(text, "iq_batch_size_count", model="syn2") == len(batches) - 1 + 2
        assert _sample(text, "iq_batch_size_sum", model="syn2") == 34
        assert _sample(text, "iq_batch_size_bucket", model="syn2", le="4.0") == \
            _sample(text, "iq_batch_size_count", model="syn2")
        assert _sample(text, "iq_batch_jobs_count", model="syn2") == len(batches)
        assert _sample(text, "iq_batch_jobs_sum", model="syn2") == 14
        assert _sample(text, "iq_inference_seconds_count", model="syn2") == len(batches)
        assert _sample(text, "iq_queue_wait_seconds_count", model="syn2") == 14
    finally:
        stack.stop()


def test_grafana_dashboard_queries_only_metrics_that_exist(stack):
    import json

    from tests.support.metrics import exported, named_in
    from scripts.stack import ROOT

    dashboard = json.loads((ROOT / "docs/grafana/inference-queue.json").read_text())
    used = named_in("\n".join(t["expr"] for p in dashboard["panels"] for t in p["targets"]))
    stack.finished(stack.submit("synthetic", ["d"])["id"])
    missing = used - exported(f"{stack.api}/metrics", stack.workers["synth"].extra["metrics_url"])
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"
    assert len(used) >= 10


def test_made_up_methods_and_paths_add_no_metric_series(stack):
    """Every label takes values from a fixed set: 50 invented methods and 50 invented paths
    are one `other` method and one `unmatched` route."""
    import socket

    def raw(request_line: str) -> None:
        with socket.create_connection(("127.0.0.1", stack.web.extra["port"]), timeout=10) as s:
            s.sendall(f"{request_line} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            while s.recv(65_536):
                pass

    for i in range(50):
        raw(f"QWERTY{i} /healthz")
        raw(f"GET /made-up-{i}")
    text = requests.get(f"{stack.api}/metrics", timeout=5).text
    assert "QWERTY" not in text and "made-up" not in text
    assert 'method="other",route="unmatched",status="405"' in text
    assert 'method="GET",route="unmatched",status="404"' in text
    series = [line for line in text.splitlines() if line.startswith("iq_http_requests_total{")]
    assert len(series) < 60, series


def test_api_metrics_are_summed_across_gunicorn_processes(tmp_path):
    """Two API processes (IQ_WEB_WORKERS=2; the default on an 8-core host): /metrics counts
    the submits both took, whichever answers the scrape, from a folder gunicorn made for this
    run and removes when it stops."""
    from concurrent.futures import ThreadPoolExecutor

    from scripts.stack import launch

    (tmp_path / "tmp").mkdir()
    models = {"idle": {"kind": "synthetic", "base_ms": 1, "per_item_ms": 0}}
    stack = launch(tmp_path, models, {}, ready_models=[],  # no worker: the jobs stay queued
                   env_extra={"IQ_WEB_WORKERS": "2", "TMPDIR": str(tmp_path / "tmp")})
    try:
        [folder] = (tmp_path / "tmp").glob("iq-api-metrics-*")

        def submit(_) -> int:
            return requests.post(f"{stack.api}/v1/jobs", json={"model": "idle", "inputs": ["t"]},
                                 timeout=10).status_code

        accepted = 0
        with ThreadPoolExecutor(16) as pool:
            for _ in range(40):  # until both processes have taken some
                accepted += sum(code == 202 for code in pool.map(submit, range(16)))
                if len({p.name for p in folder.glob("counter_*.db")}) >= 2:
                    break
        assert len(list(folder.glob("counter_*.db"))) == 2, "both processes must have served"
        for _ in range(4):  # each scrape may be answered by either process
            text = requests.get(f"{stack.api}/metrics", timeout=5).text
            assert _sample(text, "iq_jobs_submitted_total", model="idle") == accepted
            assert "iq_queue_depth{" in text  # read from Redis at scrape time, as with one
    finally:
        stack.stop()
    assert not folder.exists()
