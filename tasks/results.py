"""How a job's outputs are written, in Redis and on the wire: as few bytes as they need; and
the stored result (`stored`, `outputs_of`), the one place that knows its format.

A float32 model's outputs are float32 values; written through Python floats they take the
shortest text that round-trips a *float64* (`0.0123456789123456789`, ~20 characters), twice
what the value holds. `compact` writes every value that a float32 holds exactly as the
shortest text that round-trips a float32 (`0.012345679`), and leaves any other value (a
float64 model's) untouched: nothing is rounded. A job may also ask for
`"encoding_format": "base64"` (embedding models): each output vector becomes the base64 of
its little-endian float32 bytes, 5.3 characters a value, as the common embeddings APIs offer.

In Redis, outputs that are all float32 vectors (an embedding model's) are kept packed: their
float32 bytes, 4 bytes a value (`stored`), turned into numbers or base64 only when read
(`outputs_of`), so one encoding or the other is a choice of the reader, not of the store.

A handler whose outputs are float32 vectors may hand each one on as a 1-D float32 numpy row
(`float32_row`): a row that packs is stored as it is, with no round trip through Python floats;
any other numpy array is read as the lists of Python numbers its `.tolist()` gives, so that
what is stored, and every answer, is byte for byte what those lists would give.
"""
from __future__ import annotations

import base64
from datetime import datetime, timezone
from typing import Any

import numpy as np
import orjson
from celery.backends.redis import RedisBackend, SentinelBackend
from kombu import serialization
from redis.connection import SSLConnection

from tasks.redis_client import SentinelConnection, SentinelSSLConnection

ENCODINGS = ("float", "base64")
# orjson writes numpy float32 values as the shortest text that round-trips a float32 (and a
# NaN or an infinity as null, as for Python floats).
JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


_NUMBERS = frozenset((float, int))


def float32_row(value: Any) -> bool:
    """A 1-D float32 numpy array: a float32 model's output row, as a handler hands it on."""
    return isinstance(value, np.ndarray) and value.dtype == np.float32 and value.ndim == 1


def _plain(value: Any) -> Any:
    """`value` with any numpy array in it (at the top, or one of a list's elements) as the
    lists of Python numbers its `.tolist()` gives: what a handler's outputs were before
    float32 rows came as arrays (`float32_row`)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list) and any(isinstance(x, np.ndarray) for x in value):
        return [x.tolist() if isinstance(x, np.ndarray) else x for x in value]
    return value


def _is_vector(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    # The common case (a model's .tolist()) checked in C: every element exactly a float or an
    # int; else each one's class, subclasses of float or int allowed and bool refused.
    return _NUMBERS.issuperset(map(type, value)) or all(
        isinstance(x, (float, int)) and not isinstance(x, bool) for x in value)


def _narrow(values: np.ndarray) -> np.ndarray:
    """float32 when that loses nothing (NaN compares unequal: an array with one stays as it
    is), else the values as they are."""
    narrow = values.astype(np.float32)
    return narrow if np.array_equal(narrow, values) else values


def compact(value: Any) -> Any:
    """`value` with its floats ready for orjson (JSON_OPTIONS) to write in as few bytes as
    keep every value exact."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
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


def to_base64(vector: list[float | None]) -> str:
    """Little-endian float32 bytes, base64: what `encoding_format: "base64"` returns. A None
    is a value JSON wrote as null (a NaN or an infinity): NaN."""
    if None in vector:
        vector = [np.nan if x is None else x for x in vector]
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def _is_vector_with_nulls(value: Any) -> bool:
    """A vector a NaN or an infinity of which JSON wrote as null (a result stored as JSON,
    since a NaN never packs): still a vector to encode, not a list to hand back as it is."""
    return isinstance(value, list) and None in value and all(
        x is None or (isinstance(x, (float, int)) and not isinstance(x, bool)) for x in value)


def encode(outputs: list, encoding: str | None) -> list:
    """A job's outputs as it asked for them."""
    if encoding == "base64":
        return [to_base64(o) if _is_vector(o) or _is_vector_with_nulls(o) else o
                for o in _plain(outputs)]
    return compact(outputs)


# A stored result whose outputs are all float32 vectors (an embedding model's) is packed: a NUL
# (no JSON text starts with one), then for one vector "1" and its values; for several "n", the
# count (uint16), each one's length (uint32) and their values one after another. Values are
# little-endian float32, 4 bytes each (~10 as text). Anything else is Celery's JSON meta.
_PACKED = b"\x00"
_ONE, _MANY = b"1", b"n"
# Celery reads stored results with this serializer (tasks/celery_app.py), so AsyncResult and
# Flower see packed outputs as the numbers they hold.
SERIALIZER = "iq-result"
CONTENT_TYPE = "application/x-iq-result"


def _packable(outputs: Any) -> list[np.ndarray] | None:
    """Each output as float32, when every one is a vector that float32 holds exactly. A
    float32 row (`float32_row`) is taken as it is, where its list would be: not empty, and
    no NaN (a NaN compares unequal to itself, so a list with one never narrows)."""
    if not isinstance(outputs, list) or not outputs or len(outputs) > 0xFFFF:
        return None
    vectors = []
    for output in outputs:
        if float32_row(output):
            if not output.size or np.isnan(output).any():
                return None
            vectors.append(output)
            continue
        if not _is_vector(output) or all(isinstance(x, int) for x in output):
            return None
        wide = np.asarray(output, dtype=np.float64)
        narrow = _narrow(wide)
        if narrow.dtype != np.float32:
            return None
        vectors.append(narrow)
    return vectors


def pack(vectors: list[np.ndarray]) -> bytes:
    values = [np.asarray(v, dtype="<f4").tobytes() for v in vectors]
    if len(vectors) == 1:
        return b"".join([_PACKED, _ONE, *values])
    lengths = np.asarray([len(v) for v in vectors], dtype="<u4")
    return b"".join([_PACKED, _MANY, len(vectors).to_bytes(2, "little"), lengths.tobytes(),
                     *values])


def unpack(raw: bytes) -> list[np.ndarray]:
    """The float32 vectors of a packed result (`pack`)."""
    if raw[1:2] == _ONE:
        return [np.frombuffer(raw, dtype="<f4", offset=2)]
    count = int.from_bytes(raw[2:4], "little")
    lengths = np.frombuffer(raw, dtype="<u4", count=count, offset=4)
    values = np.frombuffer(raw, dtype="<f4", offset=4 + 4 * count)
    return np.split(values, np.cumsum(lengths)[:-1])


def stored(job_id: str, *, outputs: list | None = None,
           error: BaseException | None = None) -> bytes:
    """A job's result as it is kept in Redis, where Celery's backend keeps a task's: outputs
    that are all float32 vectors packed (`pack`), else Celery's JSON meta (SUCCESS with
    `{"outputs": ...}`, or FAILURE with `error` encoded as Celery encodes an exception for
    JSON; a NaN or infinite value is null). Either way AsyncResult reads it with this app
    (`SERIALIZER`); tests/integration/test_broker.py checks it against Celery's own
    `store_result`."""
    if error is None:
        vectors = _packable(outputs)
        if vectors is not None:
            return pack(vectors)
        state: str = "SUCCESS"
        result: Any = {"outputs": compact(outputs)}
    else:
        state = "FAILURE"
        result = {"exc_type": type(error).__qualname__, "exc_message": list(error.args),
                  "exc_module": type(error).__module__}
    meta = {"status": state, "result": result, "traceback": None, "children": None,
            "date_done": datetime.now(timezone.utc).isoformat(), "task_id": job_id}
    return orjson.dumps(meta, option=JSON_OPTIONS)


def _as_numbers(vectors: list[np.ndarray]) -> list:
    """Float32 vectors as JSON numbers: each value the shortest text that round-trips its
    float32, read back as the Python float that text means (what the JSON meta held)."""
    return orjson.loads(orjson.dumps(vectors, option=JSON_OPTIONS))


def outputs_of(meta: bytes | str | None, encoding: str | None = None) -> list | None:
    """The outputs of a stored result, written as `encoding` asks (`encode`); None for a
    failure, or when there is none."""
    if not meta:
        return None
    if isinstance(meta, bytes) and meta.startswith(_PACKED):
        vectors = unpack(meta)
        if encoding == "base64":
            return [base64.b64encode(v.tobytes()).decode() for v in vectors]
        return _as_numbers(vectors)
    result = orjson.loads(meta).get("result")
    outputs = result.get("outputs") if isinstance(result, dict) else None
    return encode(outputs, encoding) if encoding == "base64" and outputs else outputs


def _meta_of(raw: bytes | str) -> dict:
    """Celery's meta of a stored result (the serializer's decoder)."""
    if isinstance(raw, bytes) and raw.startswith(_PACKED):
        return {"status": "SUCCESS", "result": {"outputs": _as_numbers(unpack(raw))},
                "traceback": None, "children": None, "date_done": None, "task_id": None}
    return orjson.loads(raw)


def _stored_meta(meta: Any) -> bytes:
    """What Celery stores (the serializer's encoder): a success's meta packed where `stored`
    would pack it, anything else JSON (Celery also tries it on an exception's arguments)."""
    meta_of_success = isinstance(meta, dict) and meta.get("status") == "SUCCESS" and \
        not meta.get("traceback") and not meta.get("children")
    result = meta.get("result") if meta_of_success else None
    if isinstance(result, dict) and set(result) == {"outputs"}:
        vectors = _packable(result["outputs"])
        if vectors is not None:
            return pack(vectors)
        meta = {**meta, "result": {"outputs": _plain(result["outputs"])}}
    return orjson.dumps(meta, option=JSON_OPTIONS)


def register_serializer() -> None:
    """Teach kombu (so Celery's result backend) `SERIALIZER`: packed results and JSON."""
    serialization.register(SERIALIZER, _stored_meta, _meta_of, content_type=CONTENT_TYPE,
                           content_encoding="binary")


class _NamesPackedResults:
    """What the app's result backends add to Celery's Redis and Sentinel ones: the task named
    in a packed result's meta (the packed form does not repeat the id its key holds, and
    `AsyncResult.get` needs it)."""

    def _get_task_meta_for(self, task_id: str) -> dict:
        meta = super()._get_task_meta_for(task_id)  # type: ignore[misc]
        if meta.get("status") == "SUCCESS" and meta.get("task_id") is None:
            meta["task_id"] = task_id
        return meta


class ResultBackend(_NamesPackedResults, RedisBackend):
    """The result backend for a redis:// or rediss:// URL."""


class SentinelResultBackend(_NamesPackedResults, SentinelBackend):
    """The result backend for Sentinel's `sentinel://...;sentinel://...` URL: it asks the
    sentinels for the primary, so it follows a failover. Its connections are dropped when a
    read fails (tasks/redis_client.SentinelConnection), so that no reply is left behind."""

    def _get_sentinel_instance(self, **params: Any) -> Any:
        tls = issubclass(params.get("connection_class") or object, SSLConnection)
        params["connection_class"] = SentinelSSLConnection if tls else SentinelConnection
        return super()._get_sentinel_instance(**params)


def backend_url(url: str) -> str:
    """Celery's result_backend for Redis at `url` (tasks.celery_app.sentinel_url's): the
    backend class that fits its scheme, named as `module:Class+url` (a Unix socket's
    `redis+socket://` as Celery's Redis backend reads it: `socket://`)."""
    backend = SentinelResultBackend if url.startswith("sentinel://") else ResultBackend
    if url.startswith("redis+socket://"):  # Celery's `socket://`, once the class is named
        url = url.removeprefix("redis+")
    return f"{__name__}:{backend.__name__}+{url}"
