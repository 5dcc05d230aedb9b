"""How a job's outputs are written, in Redis and on the wire: as few bytes as they need; and
the stored result (`stored`, `outputs_of`), the one place that knows its format.

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
from datetime import datetime, timezone
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


def encode(outputs: list, encoding: str | None) -> list:
    """A job's outputs as it asked for them."""
    if encoding == "base64":
        return [to_base64(o) if _is_vector(o) else o for o in outputs]
    return compact(outputs)


def stored(job_id: str, *, outputs: list | None = None,
           error: BaseException | None = None) -> bytes:
    """A job's result as Celery's Redis backend stores it, so that AsyncResult and Flower read
    it: SUCCESS with `{"outputs": ...}`, or FAILURE with `error` encoded as Celery encodes an
    exception for JSON. `outputs` as `encode` wrote them; a NaN or infinite value is null
    (JSON has neither). tests/integration/test_broker.py checks it against Celery's own
    `store_result`."""
    if error is not None:
        state = "FAILURE"
        result: Any = {"exc_type": type(error).__qualname__, "exc_message": list(error.args),
                       "exc_module": type(error).__module__}
    else:
        state, result = "SUCCESS", {"outputs": outputs}
    meta = {"status": state, "result": result, "traceback": None, "children": None,
            "date_done": datetime.now(timezone.utc).isoformat(), "task_id": job_id}
    return orjson.dumps(meta, option=JSON_OPTIONS)


def outputs_of(meta: bytes | str | None) -> list | None:
    """The outputs of a stored result; None for a failure, or when there is none."""
    if not meta:
        return None
    result = orjson.loads(meta).get("result")
    return result.get("outputs") if isinstance(result, dict) else None
