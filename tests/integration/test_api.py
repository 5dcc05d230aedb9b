"""The HTTP API end to end: real gunicorn, real Redis, real prefork workers."""
from __future__ import annotations

import time
import uuid

import requests

from scripts.stack import wait_until


def test_submit_returns_202_with_location_and_trace_id(stack):
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "minilm-embed", "inputs": ["hi"]},
                      headers={"X-Request-ID": "trace-abc-123"}, timeout=10)
    assert r.status_code == 202
    body = r.json()
    assert body["status"] == "queued" and body["model"] == "minilm-embed"
    assert body["url"] == f"/v1/jobs/{body['id']}"
    assert r.headers["Location"] == body["url"]
    assert r.headers["X-Request-ID"] == "trace-abc-123"
    assert body["created_at"].endswith("Z")
    done = stack.finished(body["id"])
    assert done["trace_id"] == "trace-abc-123"


def test_poll_until_succeeded(stack):
    job = stack.submit("minilm-embed", ["hello world", "how are you"])
    seen: list[str] = []

    def poll() -> bool:  # plain GETs, as a client without ?wait polls
        seen.append(stack.job(job["id"])["status"])
        return seen[-1] in ("succeeded", "failed", "cancelled", "expired")

    wait_until(poll, 60, "the job to finish", interval=0.02)
    body = stack.job(job["id"])
    assert body["status"] == "succeeded"
    # Statuses only move forward: queued, then running, then succeeded.
    order = ["queued", "running", "succeeded"]
    assert [order.index(s) for s in seen] == sorted(order.index(s) for s in seen)
    assert body["started_at"] and body["finished_at"]
    assert body["created_at"] <= body["started_at"] <= body["finished_at"]
    outputs = body["result"]["outputs"]
    assert len(outputs) == 2 and all(len(v) == 384 for v in outputs)
    # The version that served it, as /v1/models lists what the live copies serve.
    served = {m["name"]: [v["version"] for v in m["versions"]]
              for m in requests.get(f"{stack.api}/v1/models", timeout=5).json()["models"]}
    assert served["minilm-embed"] == [body["model_version"]]


def test_wait_returns_as_soon_as_the_job_finishes(stack):
    job = stack.submit("synthetic", ["a"])  # a 300 ms batch
    started = time.monotonic()
    body = stack.job(job["id"], wait=20)
    # Woken by the job's done channel: a wait that only timed out would take the 20 s.
    assert time.monotonic() - started < 10
    assert body["status"] == "succeeded"
    assert body["result"] == {"outputs": [1]}


def test_wait_times_out_on_a_job_still_queued(stack):
    # Occupy the sleepy model's only child, then ask for a job queued behind it.
    first = stack.submit("sleepy", ["x"])
    second = stack.submit("sleepy", ["y"] * 4)  # a full batch: cannot join the first
    third = stack.submit("sleepy", ["z"] * 4)
    r = requests.get(f"{stack.api}/v1/jobs/{third['id']}", params={"wait": 1}, timeout=10)
    assert r.status_code == 200
    assert r.json()["status"] in ("queued", "running")
    for job in (first, second, third):
        assert stack.finished(job["id"], timeout=60)["status"] == "succeeded"


def test_prefer_wait_answers_the_post_with_the_finished_job(stack):
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "synthetic", "inputs": ["a", "b"]},
                      headers={"Prefer": "wait=20"}, timeout=30)
    assert r.status_code == 201, r.text
    assert r.headers["Preference-Applied"] == "wait=20"
    body = r.json()
    assert body["status"] == "succeeded" and body["result"] == {"outputs": [1, 1]}
    assert r.headers["Location"] == body["url"] == f"/v1/jobs/{body['id']}"
    # The same job as a later GET shows it.
    assert stack.job(body["id"])["result"] == body["result"]


def test_prefer_wait_answers_from_the_finish_without_reading_the_job(stack):
    # The finish brings the job to the waiting process on its reply channel (issue 40): the
    # answer is the job as a GET reads it, and the wait reads nothing after the finish (no
    # GET of the result, which only a read sends).
    def gets() -> int:
        return stack.admin.info("commandstats").get("cmdstat_get", {}).get("calls", 0)

    before, bodies = gets(), []
    for i in range(6):
        r = requests.post(f"{stack.api}/v1/jobs",
                          json={"model": "synthetic", "inputs": ["a"] * (1 + i % 2)},
                          headers={"Prefer": "wait=20"}, timeout=30)
        assert r.status_code == 201, r.text
        bodies.append(r.json())
    assert gets() - before < 3  # was 6: one a job
    for body in bodies:
        assert stack.job(body["id"]) == body


def test_prefer_wait_past_its_time_is_the_usual_202(stack):
    # Occupy the sleepy model's only child so that the job cannot finish within the wait.
    first = stack.submit("sleepy", ["x"] * 4)
    r = requests.post(f"{stack.api}/v1/jobs", json={"model": "sleepy", "inputs": ["y"] * 4},
                      headers={"Prefer": "respond-async, wait=0.5"}, timeout=30)
    assert r.status_code == 202, r.text
    assert r.headers["Preference-Applied"] == "wait=0.5"
    assert r.json()["status"] == "queued"
    for job_id in (first["id"], r.json()["id"]):
        assert stack.finished(job_id, timeout=60)["status"] == "succeeded"


def test_a_prefer_header_not_understood_is_ignored(stack):
    for prefer in ("wait=soon", "wait=-3", "return=minimal", "wait"):
        r = requests.post(f"{stack.api}/v1/jobs",
                          json={"model": "synthetic", "inputs": ["a"]},
                          headers={"Prefer": prefer}, timeout=10)
        assert r.status_code == 202, (prefer, r.text)
        assert "Preference-Applied" not in r.headers
        assert r.json()["status"] == "queued"


def test_unknown_job_is_404_not_queued(stack):
    for job_id in (str(uuid.uuid4()), "not-a-uuid", "x" * 300):
        r = requests.get(f"{stack.api}/v1/jobs/{job_id}", timeout=5)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "not_found"


def test_wait_parameter_is_validated(stack):
    job = stack.submit("synthetic", ["a"])
    for bad in ("0", "-1", "31", "abc"):
        r = requests.get(f"{stack.api}/v1/jobs/{job['id']}", params={"wait": bad}, timeout=5)
        assert r.status_code == 422
        assert "wait" in r.json()["error"]["fields"]


def test_models_lists_every_model_with_live_workers(stack):
    r = requests.get(f"{stack.api}/v1/models", timeout=5)
    assert r.status_code == 200
    models = {m["name"]: m for m in r.json()["models"]}
    assert set(models) == {"minilm-embed", "minilm-classify", "ts-affine", "export-linear",
                           "tiny-seqcls", "tiny-vision", "vision-defaults", "synthetic",
                           "sleepy", "patient", "chunky"}
    embed = models["minilm-embed"]
    assert embed["kind"] == "embedding" and embed["queue"] == "minilm-embed"
    assert embed["max_batch_size"] == 16 and embed["max_wait_ms"] == 5
    assert embed["limits"] == {"max_inputs": 64, "max_input_chars": 5000}
    assert embed["workers"] == 1 and embed["instances"] == 1
    assert models["ts-affine"]["limits"]["input_shape"] == [4]


def test_models_describe_each_models_input(stack):
    models = {m["name"]: m for m in
              requests.get(f"{stack.api}/v1/models", timeout=5).json()["models"]}
    assert models["minilm-embed"]["input"] == {"type": "text"}
    assert models["export-linear"]["input"] == {"type": "tensor", "shape": [4],
                                                "dtype": "float32"}
    seqcls = models["tiny-seqcls"]
    assert seqcls["kind"] == "sequence-classification" and seqcls["input"]["type"] == "text"
    assert seqcls["labels"] == ["negative", "neutral", "positive"]  # read from its folder
    vision = models["tiny-vision"]
    assert vision["input"]["type"] == "image"
    assert vision["input"]["sources"] == ["base64", "data_uri", "url", "upload"]
    assert "PNG" in vision["input"]["formats"]
    assert vision["input"]["preprocess"]["size"] == [32, 32]
    assert vision["limits"] == {"max_inputs": 8, "max_image_bytes": 150_000,
                                "max_image_pixels": 1_000_000}


def test_the_openapi_document_gives_each_model_its_own_inputs_and_limits(stack):
    document = requests.get(f"{stack.api}/openapi.json", timeout=5).json()
    schemas = document["components"]["schemas"]

    def resolved(schema: dict) -> dict:
        return schemas[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema

    jobs = {resolved(job)["properties"]["model"]["enum"][0]: resolved(job)
            for job in schemas["JobRequest"]["oneOf"]}
    assert set(jobs) == {m["name"] for m in
                         requests.get(f"{stack.api}/v1/models", timeout=5).json()["models"]}
    embed = jobs["minilm-embed"]["properties"]
    assert embed["model"]["enum"] == ["minilm-embed"]
    assert embed["inputs"]["maxItems"] == 64 and embed["inputs"]["items"]["maxLength"] == 5000
    tensor = jobs["export-linear"]["properties"]["inputs"]
    assert tensor["maxItems"] == 16
    assert tensor["items"]["minItems"] == tensor["items"]["maxItems"] == 4
    assert resolved(jobs["minilm-classify"]["properties"]["options"])["properties"]["labels"]
    assert resolved(jobs["minilm-embed"]["properties"]["options"])["properties"] == {}
    assert "150000 bytes" in jobs["tiny-vision"]["properties"]["inputs"]["items"]["description"]
    post = document["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data", "image/*"} <= set(post)
    listed = document["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]
    assert resolved(listed["application/json"]["schema"])["properties"]["models"]["items"] == {
        "$ref": "#/components/schemas/Model"}
    # Bounds come from the settings and the schemas, not from a copy: `wait` is max_wait_s.
    wait = document["paths"]["/v1/jobs/{job_id}"]["get"]["parameters"][0]
    assert wait["name"] == "wait" and wait["schema"]["maximum"] == 30
    assert wait["schema"]["exclusiveMinimum"] == 0
    assert "webhook" in embed


def test_health_and_readiness(stack):
    assert requests.get(f"{stack.api}/healthz", timeout=5).json() == {"status": "ok"}
    r = requests.get(f"{stack.api}/readyz", timeout=5)
    assert r.status_code == 200
    checks = r.json()["checks"]
    assert checks["redis"]["ok"] and checks["model:sleepy"]["instances"] == 1


def test_metrics_count_requests_and_jobs(stack):
    stack.submit("synthetic", ["m"])
    requests.post(f"{stack.api}/v1/jobs", json={"model": "nope", "inputs": ["x"]}, timeout=5)
    text = requests.get(f"{stack.api}/metrics", timeout=5).text
    assert 'iq_jobs_submitted_total{model="synthetic"}' in text
    assert 'iq_jobs_rejected_total{model="unknown",reason="validation"}' in text
    assert 'iq_http_requests_total{method="POST",route="/v1/jobs",status="202"}' in text
    assert "iq_http_request_duration_seconds_bucket" in text
    assert 'iq_queue_depth{model="minilm-embed"}' in text


def test_outputs_past_their_ttl_say_so(stack):
    body = stack.finished(stack.submit("synthetic", ["short-lived"])["id"])
    assert body["result"] == {"outputs": [len("short-lived")]}
    # The outputs expire after result_ttl_s, the record after job_ttl_s: as if that passed.
    assert stack.redis.delete(f"celery-task-meta-{body['id']}") == 1
    again = stack.job(body["id"])
    assert again["status"] == "succeeded"
    assert again["result"] is None and again["result_expired"] is True
