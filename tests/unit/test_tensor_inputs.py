"""A tensor model's inputs: every number the schema takes can be written into the job's task
message (orjson takes integers of 64 bits, either sign). A float model's integer past that but
inside its dtype's range (10**38 for float32) passed the schema as it was, and the API answered
500 when it built the message; it is taken as the float the model computes with."""
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


@pytest.mark.parametrize("number", [10**30, -(2**63) - 1, 2**64, -(10**38)])
def test_an_integer_past_64_bits_is_taken_as_a_float(number):
    job = F32.load({"model": "f32", "inputs": [[1, number], [2**64 - 1, -(2**63)]]})
    assert job["inputs"] == [[1, float(number)], [2**64 - 1, -(2**63)]]
    assert [type(n) for n in job["inputs"][0]] == [int, float]
    assert orjson.loads(orjson.dumps(job))["inputs"][0][1] == float(number)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(10**40), max_value=10**40))
def test_every_integer_the_schema_takes_goes_into_a_task_message(number):
    try:
        job = F32.load({"model": "f32", "inputs": [[number, 2**64 - 1]]})
    except ValidationError:
        assert abs(number) > 3.4028234663852886e38
        return
    assert orjson.loads(orjson.dumps(job))["inputs"] == job["inputs"]
