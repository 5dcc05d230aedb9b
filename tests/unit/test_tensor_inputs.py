"""A tensor model's inputs: every number the schema accepts can be written into the job's task
message (orjson takes integers of 64 bits, either sign). An integer past that but inside
float32's range passed the schema and the API answered 500 when it built the message."""
from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings, strategies as st
from marshmallow import ValidationError

from app.schemas import job_schema
from config.models import parse_model

F32 = job_schema(parse_model("f32", {"kind": "torchscript", "path": "m.pt", "input_shape": [2]},
                             Path("/nonexistent")))


@pytest.mark.parametrize("number", [10**30, -(2**63) - 1, 2**64])
def test_an_integer_past_64_bits_is_refused_naming_the_input(number):
    with pytest.raises(ValidationError) as refused:
        F32.load({"model": "f32", "inputs": [[1.0, number]]})
    assert refused.value.messages == {"inputs": {0: [
        "integers must fit in 64 bits; write a larger number as a float "
        "(1e30, not 1000000000000000000000000000000)"]}}


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(10**40), max_value=10**40))
def test_every_integer_the_schema_accepts_goes_into_a_task_message(number):
    try:
        job = F32.load({"model": "f32", "inputs": [[number, 2**64 - 1]]})
    except ValidationError:
        return
    assert orjson.loads(orjson.dumps(job))["inputs"] == [[number, 2**64 - 1]]
