"""A kind of one's own through a real stack: the tests' `echo` kind (tests/support/kinds/),
registered by the models file's `kinds:` list and touching no production file, serves a job
end to end (the API validates it, a prefork pool child runs its handler), and the OpenAPI
document and GET /v1/models show its input."""
from __future__ import annotations

import psutil
import pytest
import requests

from scripts.stack import launch

MODELS = {
    "hello": {"kind": "echo", "times": 2, "sep": "+", "max_input_chars": 12, "max_inputs": 4},
    "synthetic": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0},
}


@pytest.fixture(scope="module")
def echo_stack(tmp_path_factory):
    stack = launch(tmp_path_factory.mktemp("kinds"), MODELS, {"w": ["hello", "synthetic"]},
                   kinds=["tests.support.kinds.echo"])
    yield stack
    stack.stop()


def test_a_job_of_a_kind_of_ones_own_runs_in_a_pool_child(echo_stack):
    body = echo_stack.finished(echo_stack.submit("hello", ["hi", "ünï"])["id"])
    assert body["status"] == "succeeded", body
    outputs = body["result"]["outputs"]
    assert [o["echo"] for o in outputs] == ["hi+hi", "ünï+ünï"]
    worker = psutil.Process(echo_stack.workers["w"].proc.pid)
    children = {p.pid for p in worker.children(recursive=True)}
    assert {o["pid"] for o in outputs} <= children
    # The shipped kinds beside it, as before.
    other = echo_stack.finished(echo_stack.submit("synthetic", ["abc"])["id"])
    assert other["result"]["outputs"] == [3]


def test_its_input_is_checked_by_the_api_from_its_kind(echo_stack):
    r = requests.post(f"{echo_stack.api}/v1/jobs", timeout=10, json={
        "model": "hello", "inputs": ["x" * 13, 5], "encoding_format": "base64"})
    assert r.status_code == 422, r.text
    assert set(r.json()["error"]["fields"]) == {"inputs.0", "inputs.1", "encoding_format"}, \
        r.json()


def test_the_openapi_document_and_the_model_list_show_its_input(echo_stack):
    document = requests.get(f"{echo_stack.api}/openapi.json", timeout=10).json()
    job = document["components"]["schemas"]["helloJob"]
    inputs = job["properties"]["inputs"]
    assert (inputs["maxItems"], inputs["items"]["type"], inputs["items"]["maxLength"]) == (
        4, "string", 12)
    refs = [ref["$ref"] for ref in document["components"]["schemas"]["JobRequest"]["oneOf"]]
    assert "#/components/schemas/helloJob" in refs
    listed = {m["name"]: m for m in
              requests.get(f"{echo_stack.api}/v1/models", timeout=10).json()["models"]}
    assert listed["hello"]["kind"] == "echo"
    assert listed["hello"]["input"] == {"type": "text"}
