"""API keys: hashed in config, required when configured, jobs private to their key, per-key
rate limits, and the OpenAPI document that says so (its security scheme, 401 and 403),
checked by schemathesis against this stack."""
from __future__ import annotations

import hashlib
import re

import pytest
import requests
import yaml

from scripts.stack import launch, wait_until
from tests.support.openapi import schemathesis
from tests.support.records import fields

KEYS = {"alice": "alice-secret-key-1234", "bob": "bob-secret-key-5678",
        "carol": "carol-secret-key-9012", "dave": "dave-secret-key-3456"}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("access")
    keys_file = workdir / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [
        {"name": "alice", "sha256": hashlib.sha256(KEYS["alice"].encode()).hexdigest()},
        {"name": "bob", "sha256": hashlib.sha256(KEYS["bob"].encode()).hexdigest(),
         "models": ["quick", "slow"]},
        {"name": "carol", "sha256": hashlib.sha256(KEYS["carol"].encode()).hexdigest(),
         "rate_per_s": 0.2, "burst": 2},
        {"name": "dave", "sha256": hashlib.sha256(KEYS["dave"].encode()).hexdigest(),
         "rate_per_s": 0.01, "burst": 3},
    ]}))
    models = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0},
              "private": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0},
              "slow": {"kind": "synthetic", "base_ms": 1500, "per_item_ms": 0}}
    stack = launch(workdir, models, {"w": ["quick", "private", "slow"]},
                   env_extra={"IQ_API_KEYS_FILE": str(keys_file)})
    yield stack
    stack.stop()


def call(stack, method, path, who=None, **kw):
    headers = kw.pop("headers", {})
    if who:
        headers["Authorization"] = f"Bearer {KEYS[who]}"
    return requests.request(method, f"{stack.api}{path}", headers=headers, timeout=10, **kw)


def test_a_key_is_required_when_keys_are_configured(secured):
    for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": "Basic x"}):
        r = call(secured, "POST", "/v1/jobs", json={"model": "quick", "inputs": ["x"]},
                 headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert call(secured, "GET", "/v1/models").status_code == 401
    assert call(secured, "GET", "/v1/models", "alice").status_code == 200
    assert call(secured, "GET", "/healthz").status_code == 200  # probes stay open


def test_a_key_limited_to_some_models_gets_403_for_others(secured):
    r = call(secured, "POST", "/v1/jobs", "bob", json={"model": "private", "inputs": ["x"]})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = call(secured, "POST", "/v1/jobs", "bob", json={"model": "quick", "inputs": ["x"]})
    assert r.status_code == 202


def test_a_job_belongs_to_the_key_that_created_it(secured):
    job = call(secured, "POST", "/v1/jobs", "alice",
               json={"model": "quick", "inputs": ["mine"]}).json()
    done = call(secured, "GET", f"/v1/jobs/{job['id']}?wait=20", "alice").json()
    assert done["status"] == "succeeded"
    assert call(secured, "GET", f"/v1/jobs/{job['id']}", "bob").status_code == 404
    assert call(secured, "GET", f"/v1/jobs/{job['id']}?wait=1", "bob").status_code == 404
    for method, path in (("POST", "/cancel"), ("POST", "/retry"), ("GET", "/events"),
                         ("DELETE", "")):
        assert call(secured, method, f"/v1/jobs/{job['id']}{path}", "bob").status_code == 404
    assert call(secured, "POST", f"/v1/jobs/{job['id']}/cancel", "alice").status_code == 409
    # Each key lists its own jobs only.
    for who, sees in (("alice", True), ("bob", False)):
        listed = call(secured, "GET", "/v1/jobs", who).json()["jobs"]
        assert (job["id"] in [j["id"] for j in listed]) is sees
    assert call(secured, "DELETE", f"/v1/jobs/{job['id']}", "alice").status_code == 204
    assert call(secured, "GET", f"/v1/jobs/{job['id']}", "alice").status_code == 404


def test_a_job_shows_its_batch_but_not_how_many_jobs_of_others_shared_it(secured):
    """A job's `batch` names the batch; with keys on, not how many jobs and items it held:
    those may be other tenants' (docs/security.md)."""
    blocker = call(secured, "POST", "/v1/jobs", "alice", json={"model": "slow", "inputs": ["b"]})
    wait_until(lambda: call(secured, "GET", f"/v1/jobs/{blocker.json()['id']}", "alice")
               .json()["status"] == "running", 60, "the blocker running")
    mine = call(secured, "POST", "/v1/jobs", "alice", json={"model": "slow", "inputs": ["a"]})
    theirs = call(secured, "POST", "/v1/jobs", "bob", json={"model": "slow", "inputs": ["b", "c"]})
    done = call(secured, "GET", f"/v1/jobs/{mine.json()['id']}?wait=20", "alice").json()
    assert done["status"] == "succeeded"
    batch_id, jobs, items = fields(secured.redis, done["id"])["batch"].split()
    assert fields(secured.redis, theirs.json()["id"])["batch"].split()[0] == batch_id  # shared
    assert (jobs, items) == ("2", "3")
    assert done["batch"] == {"id": batch_id}
    listed = call(secured, "GET", "/v1/jobs?model=slow", "alice").json()["jobs"]
    assert [j["batch"] for j in listed if j["id"] == done["id"]] == [done["batch"]]


def test_per_key_rate_limit_answers_429_with_retry_after(secured):
    codes = [call(secured, "POST", "/v1/jobs", "carol",
                  json={"model": "quick", "inputs": ["r"]}) for _ in range(3)]
    assert [r.status_code for r in codes[:2]] == [202, 202]
    assert codes[2].status_code == 429
    assert codes[2].json()["error"]["code"] == "rate_limited"
    assert int(codes[2].headers["Retry-After"]) >= 1
    # Another key is not limited by carol's bucket.
    r = call(secured, "POST", "/v1/jobs", "alice", json={"model": "quick", "inputs": ["r"]})
    assert r.status_code == 202


def test_the_rate_limit_is_taken_before_the_body_is_validated_or_its_webhook_looked_up(secured):
    """Invalid jobs spend the key's tokens too: past its burst a key gets 429, however bad
    its bodies, and a webhook host is not looked up (its DNS answer would be a 422)."""
    bad = [{"model": "quick", "inputs": []}, {"model": ["quick"], "inputs": ["x"]}, "junk",
           {"model": "quick", "inputs": ["x"], "webhook": {"url": "http://no-such-host.invalid/"}}]
    codes = [call(secured, "POST", "/v1/jobs", "dave", json=body).status_code
             for body in bad + bad]
    assert codes[:3] == [422, 422, 422]
    assert set(codes[3:]) == {429}, codes


def test_keys_are_never_logged(secured):
    done = call(secured, "POST", "/v1/jobs", "alice", json={"model": "quick", "inputs": ["log"]},
                headers={"Prefer": "wait=10"})
    assert done.status_code == 201, done.text
    call(secured, "GET", "/v1/models", headers={"Authorization": "Bearer wrong-key-abc"})

    def logs() -> str:
        return "".join(p.read_text() for p in secured.workdir.glob("*.log"))

    # The worker's line for its batch (the job was logged), written just after the job's result
    # is stored: the answer can come first.
    wait_until(lambda: done.json()["id"] in logs(), 30, "the worker's line for the batch")
    written = logs()
    for key in [*KEYS.values(), "wrong-key-abc"]:
        assert key not in written


def test_the_document_declares_the_key_and_its_refusals(secured):
    document = call(secured, "GET", "/openapi.json").json()  # open, like the probes
    assert document["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer", "description": document["components"]
        ["securitySchemes"]["apiKey"]["description"]}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method == "parameters" or not path.startswith("/v1"):
                continue
            assert operation["security"] == [{"apiKey": []}], (method, path)
            assert "401" in operation["responses"], (method, path)
            assert "WWW-Authenticate" in operation["responses"]["401"]["headers"]
            # Every keyed request but a submit costs from its key's read budget.
            assert "Retry-After" in operation["responses"]["429"]["headers"], (method, path)
    submit = document["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"403", "429"} <= set(submit)


def test_schemathesis_finds_the_keyed_api_as_its_document_says(secured):
    """With bob's key (one model of two: 403 for the other), every check, the stateful phase
    included; its `ignored_auth` check sends each request without the key too and expects
    the 401 the document declares."""
    run = schemathesis(secured.api, "--header", f"Authorization: Bearer {KEYS['bob']}",
                       max_examples=10)
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-3000:]
    assert "Tested: 11" in run.stdout, run.stdout[-3000:]  # every operation, none skipped
    assert re.search(r"Stateful.*?Scenarios:\s+[1-9]", run.stdout, re.S), run.stdout[-3000:]
