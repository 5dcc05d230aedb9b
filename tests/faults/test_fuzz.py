"""Bad input, generated: request bodies from the API's own OpenAPI document (hypothesis-
jsonschema) and from arbitrary JSON, plus the nastiest hand-picked cases. Whatever comes in,
the answer is never a 5xx, every error has the JSON error shape, and the service still
serves correctly afterwards."""
from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=5),
    max_leaves=25)


def check(response: requests.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    if response.status_code >= 400:
        assert set(body) == {"error"}
        assert isinstance(body["error"]["code"], str) and isinstance(body["error"]["message"], str)
    elif response.status_code == 202:
        assert uuid.UUID(body["id"]) and body["status"] == "queued"


@pytest.fixture(scope="module")
def job_schema(stack):
    document = requests.get(f"{stack.api}/openapi.json", timeout=5).json()
    schema = json.loads(json.dumps(document["components"]["schemas"]["JobRequest"]))
    # Valid jobs are accepted and run: keep them small so the shared workers drain them fast.
    for job in schema["oneOf"]:
        job["properties"]["inputs"]["maxItems"] = 2
    return schema


def test_openapi_document_describes_the_job_endpoints(stack, job_schema):
    document = requests.get(f"{stack.api}/openapi.json", timeout=5).json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/models"} <= set(document["paths"])
    models = {m for job in job_schema["oneOf"] for m in job["properties"]["model"]["enum"]}
    assert models >= {"minilm-embed", "ts-affine"}


def test_bodies_from_the_openapi_schema(stack, job_schema):
    session = requests.Session()

    @FUZZ
    @given(from_schema(job_schema))
    def run(body):
        check(session.post(f"{stack.api}/v1/jobs", json=body, timeout=10))

    run()


def test_arbitrary_json_bodies(stack):
    session = requests.Session()

    @FUZZ
    @given(json_values)
    def run(body):
        data = json.dumps(body, allow_nan=True).encode()
        check(session.post(f"{stack.api}/v1/jobs", data=data,
                           headers={"Content-Type": "application/json"}, timeout=10))

    run()


@pytest.mark.parametrize("data, content_type", [
    (b"\xff\xfe\xfa", "application/json"),
    (b'{"model": "minilm-embed", "inputs": ["\\ud800"]}', "application/json"),
    (b'{"model": "minilm-embed", "inputs": ["\\u0000\\u200b\\ufeff\\U0001F600"]}',
     "application/json"),
    (b'{"model": "ts-affine", "inputs": [[NaN, Infinity, -Infinity, 1e999]]}',
     "application/json"),
    (b'{"model": "ts-affine", "inputs": [[1e308, -1e308, 0, 1]]}', "application/json"),
    (b"[" * 50_000 + b"]" * 50_000, "application/json"),
    (b'{"a":' * 5_000 + b"1" + b"}" * 5_000, "application/json"),
    (b'{"model": "minilm-embed", "inputs": ["x"]}', "text/plain"),
    (b'{"model": "minilm-embed", "inputs": ["x"]}', "application/xml"),
    (b"model=minilm-embed", "application/x-www-form-urlencoded"),
    (b"", "application/json"),
    (b"null", "application/json"),
    (b'"just a string"', "application/json"),
    (json.dumps({"model": "minilm-embed", "inputs": ["y" * 900_000]}).encode(),
     "application/json"),
    (b"{" + b" " * 3_000_000 + b"}", "application/json"),
])
def test_hand_picked_bad_bodies(stack, data, content_type):
    check(requests.post(f"{stack.api}/v1/jobs", data=data,
                        headers={"Content-Type": content_type}, timeout=30))


def test_ten_thousand_ids_never_issued_are_all_404(stack):
    def probe(i: int) -> int:
        job_id = str(uuid.uuid4()) if i % 2 else f"bogus-{i}"
        return requests.get(f"{stack.api}/v1/jobs/{job_id}", timeout=10).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(probe, range(10_000)))
    assert set(codes) == {404}


def test_the_service_still_answers_correctly_afterwards(stack):
    body = stack.finished(stack.submit("ts-affine", [[1, 2, 3, 4]])["id"])
    assert body["status"] == "succeeded" and body["result"]["outputs"] == [[3, 5, 7, 9]]
    assert requests.get(f"{stack.api}/readyz", timeout=5).status_code == 200
