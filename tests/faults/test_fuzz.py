"""Bad input, generated: every operation of the live API run by schemathesis from the API's
own OpenAPI document with every check it has, stateful sequences included; arbitrary JSON
bodies; and the nastiest hand-picked cases. Whatever comes in, the answer is never a 5xx,
every status, header and body is one the document declares, anything the document forbids is
refused, and the service still serves correctly afterwards."""
from __future__ import annotations

import json
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.openapi import schemathesis

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


def test_the_live_api_answers_as_its_openapi_document_says_with_every_check(stack):
    """schemathesis with `--checks all` over every phase against the live stack: examples,
    coverage (each bound of each field, each documented status), fuzzing (valid and mutated
    requests) and the stateful phase, which follows the document's links from a submitted
    job to reading, cancelling, retrying, deleting it and following its events, and checks
    that a created job can be found and a deleted one cannot. Any answer the document does
    not declare (status, header, body, content type), a 5xx, a valid request refused or an
    invalid one accepted fails it. tests/support/schemathesis.toml says what differs from
    the tool's defaults, and why."""
    run = schemathesis(stack.api)
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-3000:]
    document = requests.get(f"{stack.api}/openapi.json", timeout=5).json()
    operations = sum(1 for item in document["paths"].values() for m in item if m != "parameters")
    assert f"Tested: {operations}" in run.stdout  # every operation, none skipped
    assert re.search(r"Stateful.*?Scenarios:\s+[1-9]", run.stdout, re.S), run.stdout
    assert re.search(r"API Links:\s+[1-9]\d* covered", run.stdout), run.stdout


def test_openapi_document_describes_the_job_endpoints(stack):
    document = requests.get(f"{stack.api}/openapi.json", timeout=5).json()
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/models"} <= set(document["paths"])
    schemas = document["components"]["schemas"]
    models = {schemas[ref["$ref"].rsplit("/", 1)[1]]["properties"]["model"]["enum"][0]
              for ref in schemas["JobRequest"]["oneOf"]}
    assert models >= {"minilm-embed", "ts-affine", "tiny-vision"}


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


def test_two_thousand_ids_never_issued_are_all_404(stack):
    sessions = threading.local()  # a connection kept open by each thread

    def probe(i: int) -> int:
        job_id = str(uuid.uuid4()) if i % 2 else f"bogus-{i}"
        if not hasattr(sessions, "http"):
            sessions.http = requests.Session()
        return sessions.http.get(f"{stack.api}/v1/jobs/{job_id}", timeout=10).status_code

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(probe, range(2_000)))
    assert set(codes) == {404}


def test_the_service_still_answers_correctly_afterwards(stack):
    body = stack.finished(stack.submit("ts-affine", [[1, 2, 3, 4]])["id"])
    assert body["status"] == "succeeded" and body["result"]["outputs"] == [[3, 5, 7, 9]]
    assert requests.get(f"{stack.api}/readyz", timeout=5).status_code == 200
