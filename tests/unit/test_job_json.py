"""A job's JSON body is read by orjson where orjson reads it as Python's json does, and by json
otherwise (app/jobs.py read_json): the same value for every body json reads, and for every
body it refuses, json's own error (the 400 names it)."""
from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.jobs import read_json


def outcome(body: bytes) -> tuple[str, str]:
    try:
        return "read", repr(json.loads(body))
    except (ValueError, RecursionError) as exc:
        return "refused", f"{type(exc).__name__}: {exc}"


def mine(body: bytes) -> tuple[str, str]:
    try:
        return "read", repr(read_json(body))
    except (ValueError, RecursionError) as exc:
        return "refused", f"{type(exc).__name__}: {exc}"


EDGES = [
    b'{"model": "echo", "inputs": ["a"]}', b'{"a":1,"a":2,"b":3}', b' {} ', b'\t[\n1\r]',
    b'1e400', b'-1e400', b'1e-400', b'5e-324', b'-0', b'-0.0', b'1.0', b'1E2', b'NaN',
    b'Infinity', b'-Infinity', b'[NaN]', b'123456789012345678901234567890',
    b'18446744073709551615', b'18446744073709551616', b'-9223372036854775808',
    b'-9223372036854775809', b'9999999999999999999', b'-9999999999999999999',
    b'{"inputs": [[1e300, 1180591620717411303424]]}', b'0.1000000000000000055511151231257827',
    b'"\\ud800"', b'"\\ud83d\\ude00"', b'"\xed\xa0\x80"', b'"\xc3\xa9"', b'"\xff"',
    b'"a\tb"', b'"\\u0000"', b'"\x7f"', b'"\\/\\b\\f\\n\\r\\t"', b'"\\x"', b'\xef\xbb\xbf{}',
    '{"a": 1}'.encode("utf-16"), '{"a": 1}'.encode("utf-16-le"), '[1]'.encode("utf-32"),
    b'', b' ', b'[1,]', b'{"a":1}x', b'\x0c{}', b'01', b'1.', b'.5', b'+1', b'[', b'{"a"}',
    b'[' * 499 + b']' * 499, b'[' * 1023 + b']' * 1023, b'[' * 1030 + b']' * 1030,
    b'[' * 100_000, b'{"a":' * 499 + b'1' + b'}' * 499, b'[' * 300 + b'{"a":' * 300 + b']',
    b'{"a": true, "b": false, "c": null}', b'"' + b'x' * 100_000 + b'"',
]


@pytest.mark.parametrize("body", EDGES, ids=lambda b: repr(b[:24]))
def test_a_body_reads_as_json_reads_it(body):
    assert mine(body) == outcome(body)


@pytest.mark.parametrize("depth", [400, 499, 700, 990, 1023])
def test_a_deep_body_reads_or_is_refused_as_json_does_under_a_deep_stack(depth):
    """json's nesting limit is what is left of Python's recursion limit: a body past it is
    refused by both, from a stack as deep as a request's and deeper."""
    body = b"[" * depth + b"]" * depth

    def nested(frames: int) -> tuple:
        return nested(frames - 1) if frames else (mine(body)[0], outcome(body)[0])

    for frames in (50, 300):
        found, expected = nested(frames)
        assert found == expected


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(), lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(JSON, st.booleans())
def test_any_json_reads_as_json_reads_it(value, ascii_only):
    body = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert mine(body) == outcome(body)


@settings(max_examples=400, deadline=None)
@given(JSON, st.integers(min_value=0), st.binary(max_size=3))
def test_a_body_changed_anywhere_reads_or_is_refused_as_json_does(value, at, bytes_):
    body = json.dumps(value).encode("utf-8", "surrogatepass")
    at = at % (len(body) + 1)
    body = body[:at] + bytes_ + body[at + len(bytes_):]
    assert mine(body) == outcome(body)


def test_a_plain_body_is_read_in_one_call_not_through_json():
    body = b'{"model": "echo", "inputs": ["a"], "options": {}, "timeout_s": 2.5}'
    read_json(body)
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        read_json(body)
    finally:
        sys.setprofile(None)
    assert calls == ["read_json"], calls


def test_a_number_past_pythons_digits_is_refused_in_the_apis_words():
    """The outside attack of session 13: the 400 quoted Python's advice to its own programmer
    ("use sys.set_int_max_str_digits() to increase the limit")."""
    from app.errors import json_problem

    with pytest.raises(ValueError) as refused:
        read_json(b'{"inputs": [' + b"9" * 5000 + b"]}")
    assert "set_int_max_str_digits" in str(refused.value)  # what json says
    assert json_problem(refused.value) == \
        f"a number of more than {sys.get_int_max_str_digits()} digits"
    assert json_problem(ValueError("Expecting value: line 1 column 1 (char 0)")) == \
        "Expecting value: line 1 column 1 (char 0)"
