"""How a job's outputs are written, in Redis and on the wire: as few bytes as they need.

A float32 model's outputs are float32 values; written through Python floats they take the
shortest text that round-trips a *float64* (`0.0123456789123456789`, ~20 characters), twice
what the value holds. `compact` writes every value that a float32 holds exactly as the
shortest text that round-trips a float32 (`0.012345679`), and leaves any other value (a
float64 model's) untouched: nothing is rounded. A job may also ask for
`"encoding_format": "base64"` (embedding models): each output vector becomes the base64 of
its little-endian float32 bytes, 5.3 characters a value, as the common embeddings APIs offer.
"""
from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson

ENCODINGS = ("float", "base64")
# orjson writes numpy float32 values as the shortest text that round-trips a float32 (and a
# NaN or an infinity as null, as for Python floats).
JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


def _is_vector(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(x, (float, int)) and not isinstance(x, bool) for x in value)


def _narrow(values: np.ndarray) -> np.ndarray:
    """float32 when that loses nothing (NaN compares unequal: an array with one stays as it
    is), else the values as they are."""
    narrow = values.astype(np.float32)
    return narrow if np.array_equal(narrow, values) else values


def compact(value: Any) -> Any:
    """`value` with its floats ready for orjson (JSON_OPTIONS) to write in as few bytes as
    keep every value exact."""
    if isinstance(value, float):
        return _narrow(np.asarray([value]))[0]
    if _is_vector(value):
        if all(isinstance(x, int) for x in value):
            return value
        return _narrow(np.asarray(value, dtype=np.float64))
    if isinstance(value, list):
        return [compact(x) for x in value]
    if isinstance(value, dict):
        return {k: compact(v) for k, v in value.items()}
    return value


def to_base64(vector: list[float]) -> str:
    """Little-endian float32 bytes, base64: what `encoding_format: "base64"` returns."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def from_base64(text: str) -> list[float]:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").astype(float).tolist()


def encode(outputs: list, encoding: str | None) -> list:
    """A job's outputs as it asked for them."""
    if encoding == "base64":
        return [to_base64(o) if _is_vector(o) else o for o in outputs]
    return compact(outputs)
