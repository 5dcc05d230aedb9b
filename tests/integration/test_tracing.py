"""OpenTelemetry traces across processes: with the standard OTEL_* variables set, one job's
spans from the API and from the worker's pool child share the job's trace id and nest as the
job ran (tasks/tracing.py). Exported over OTLP/HTTP to a receiver in the test."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.support.otlp import Receiver
from scripts.stack import launch, wait_until


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    receiver = Receiver()
    models = {"traced": {"kind": "synthetic", "base_ms": 300, "per_item_ms": 0,
                         "max_batch_size": 8}}
    stack = launch(tmp_path_factory.mktemp("tracing"), models, {"w": ["traced"]}, env_extra={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "200"})
    yield stack, receiver
    stack.stop()
    receiver.stop()


def test_one_jobs_spans_share_its_trace_id_and_nest(traced):
    stack, receiver = traced
    blocker = stack.submit("traced", ["first"])  # the next ones wait for it, then share a batch
    with ThreadPoolExecutor(3) as pool:
        jobs = list(pool.map(lambda i: stack.submit("traced", [f"job-{i}"]), range(3)))
    done = [stack.finished(j["id"]) for j in [blocker, *jobs]]
    assert {d["status"] for d in done} == {"succeeded"}
    job = done[1]
    trace_id = job["trace_id"]
    assert len(trace_id) == 32 and int(trace_id, 16)

    names = {"POST /v1/jobs", "iq.queue_wait", "iq.batch", "iq.model", "iq.result.write"}
    wait_until(lambda: names <= {s.name for s in receiver.of_trace(trace_id)}, 30,
               "the job's spans from the API and the worker")
    spans = receiver.of_trace(trace_id)
    by_name = {s.name: s for s in spans if s.name in names}
    post = by_name["POST /v1/jobs"]
    assert post.service == "inference-queue-api" and post.parent_id == ""
    for name in ("iq.queue_wait", "iq.batch", "iq.model", "iq.result.write"):
        assert by_name[name].service == "inference-queue-worker"
    assert by_name["iq.queue_wait"].parent_id == post.span_id
    assert by_name["iq.batch"].parent_id == post.span_id
    assert by_name["iq.model"].parent_id == by_name["iq.batch"].span_id
    assert by_name["iq.result.write"].parent_id == by_name["iq.batch"].span_id
    # The submit script is there too, under the POST of the request that sent it: the lone
    # blocker's own call. Submits that arrive together go to Redis in one call (the group
    # commit, tasks/group_commit.py), whose span is under the first one's POST only.
    lone = done[0]["trace_id"]

    def lone_spans():
        found = receiver.of_trace(lone)
        return found if any(s.attributes.get("db.system") == "redis" for s in found) else None

    found = wait_until(lone_spans, 30, "the lone submit's script span")
    lone_post = next(s for s in found if s.name == "POST /v1/jobs")
    assert any(s.parent_id == lone_post.span_id and s.attributes.get("db.system") == "redis"
               for s in found)
    # The batch: its size, and the other jobs in it as links to their own traces.
    batch = by_name["iq.batch"]
    assert batch.attributes["iq.batch.id"] == job["batch"]["id"]
    assert batch.attributes["iq.batch.jobs"] == job["batch"]["jobs"]
    mates = [d for d in done if d["batch"]["id"] == job["batch"]["id"] and d["id"] != job["id"]]
    assert mates, "the jobs were meant to share a batch"
    assert {t for t, _span in batch.links} == {d["trace_id"] for d in mates}


def test_traces_are_off_by_default(stack):
    # The shared stack sets no OTEL_* variable: the job's trace id is the API's own, and
    # a caller's X-Request-ID is kept as it is.
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "synthetic", "inputs": ["a"]},
                      headers={"X-Request-ID": "my-own-id"}, timeout=10)
    assert r.json()["trace_id"] == "my-own-id"
