"""The request schemas alone (no HTTP): numbers each input dtype can hold, lengths before
items, and the JSON schema each custom field gives the OpenAPI document."""
from __future__ import annotations

from pathlib import Path

import pytest
from marshmallow import ValidationError

from app.schemas import TensorInput, flatten, job_schema, validate_job
from config.models import parse_model

MODELS = {name: parse_model(name, raw, Path("/nonexistent")) for name, raw in {
    "f32": {"kind": "torchscript", "path": "m.pt", "input_shape": [2], "max_inputs": 4},
    "f64": {"kind": "torchscript", "path": "m.pt", "input_shape": [2],
            "input_dtype": "float64"},
    "i64": {"kind": "torchscript", "path": "m.pt", "input_shape": [2], "input_dtype": "int64"},
}.items()}
SCHEMAS = {name: job_schema(spec) for name, spec in MODELS.items()}


def errors(body) -> dict[str, list[str]]:
    with pytest.raises(ValidationError) as caught:
        validate_job(body, MODELS, SCHEMAS)
    return dict(flatten(caught.value.messages))


@pytest.mark.parametrize("model, row", [
    ("f32", [1e300, 0]), ("f32", [3.5e38, 0]), ("f32", [10**39, 0]),
    ("f64", [10**400, 0]), ("f64", [-(10**309), 0]),
    ("i64", [2**63, 0]), ("i64", [-(2**63) - 1, 0]), ("i64", [2**70, 0]), ("i64", [1e19, 0]),
    ("i64", [1.5, 0]), ("i64", [10**400, 0]),
])
def test_numbers_the_dtype_cannot_hold_are_refused_naming_the_input(model, row):
    found = errors({"model": model, "inputs": [[0, 0], row]})
    assert list(found) == ["inputs.1"], found
    assert "range" in found["inputs.1"][0] or "integers" in found["inputs.1"][0]


@pytest.mark.parametrize("model, row", [
    ("f32", [3.4e38, -3.4e38]), ("f32", [10**38, 1e-300]), ("f64", [1e300, 10**300]),
    ("i64", [2**63 - 1, -(2**63)]), ("i64", [3.0, -7]),
])
def test_numbers_at_the_edges_of_the_range_are_taken(model, row):
    """Taken as they are, but for a float model's integer past 64 bits, taken as the float the
    model computes with (no JSON encoder of the task message takes it: tests/unit/
    test_tensor_inputs.py)."""
    spec, job = validate_job({"model": model, "inputs": [row]}, MODELS, SCHEMAS)
    as_sent = [n if isinstance(n, float) or -(2**63) <= n < 2**64 else float(n) for n in row]
    assert spec.name == model and job["inputs"] == [as_sent]


def test_a_list_over_its_length_is_refused_before_its_items_are_looked_at():
    class Exploding(list):
        def __iter__(self):
            raise AssertionError("items were looked at")

    found = errors({"model": "f32", "inputs": Exploding([[0, 0]] * 5)})
    assert list(found) == ["inputs"] and "4" in found["inputs"][0]


def test_a_body_with_more_keys_than_a_job_names_only_the_unknown_ones():
    found = errors({"model": "f32", "inputs": [[0, 0]], **{f"x{i}": i for i in range(10)}})
    assert set(found) == {f"x{i}" for i in range(10)}


def test_the_tensor_field_describes_itself_to_the_openapi_document():
    schema = TensorInput((2, 3), "int64").openapi()
    assert schema["minItems"] == schema["maxItems"] == 2
    inner = schema["items"]["items"]
    assert schema["items"]["maxItems"] == 3
    assert inner == {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}


def _documented_webhook() -> dict:
    """The webhook's JSON schema as the OpenAPI document gives it (apispec, as app/openapi.py)."""
    from apispec import APISpec
    from apispec.ext.marshmallow import MarshmallowPlugin

    from app.schemas import WebhookSchema

    spec = APISpec("t", "1", "3.1.0", plugins=[MarshmallowPlugin()])
    spec.components.schema("Webhook", schema=WebhookSchema)
    return spec.to_dict()["components"]["schemas"]["Webhook"]


@pytest.mark.parametrize("url, taken", [
    ("", False), ("x", False), ("http://", False), ("ftp://example.com/", False),
    ("http:// example.com/", False), ("http://example.com/a b", False),
    ("http://user:secret@example.com/", False), ("http://[zz]/", False),
    ("http://example.com:99999/", False), ("http://example.com:0/", False),
    ("https://example.com", True), ("HTTP://example.com:8080/hook?a=1#x", True),
    ("http://[::1]:9000/", True), ("http://hooks.internal_name/", True),
    ("http://example.com:65535/", True), ("http://example.com:0080/", True),
    ("http://example.com:65536/", False),
])
def test_the_document_refuses_every_webhook_url_whose_form_the_api_refuses(url, taken):
    """schemathesis found `{"url": ""}` valid by the document and refused by the API (422):
    the URL's form is in the document; what the API still refuses past it is only what no
    schema can say (the host's addresses: app/submission.py)."""
    import jsonschema_rs

    from app.schemas import WebhookSchema

    documented = jsonschema_rs.validator_for(_documented_webhook()).is_valid({"url": url})
    refusal = WebhookSchema().validate({"url": url})
    assert (documented, not refusal) == (taken, taken), (documented, refusal)
