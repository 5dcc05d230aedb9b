"""A float32 model's rows handed on as numpy arrays (workers/child/handlers/base.output_rows)
store, and read back, byte for byte as the lists of Python floats that `.tolist()` gave:
packed results, JSON results (a NaN, an empty row), every encoding of the answer, and
Celery's own view; a float64 model's outputs keep the lists, never narrowed."""
from __future__ import annotations

import re

import numpy as np
import orjson
import pytest
import torch

from tasks import results
from workers.child.handlers.base import output_rows


def _rows(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05


def _with(tensor: torch.Tensor, *spots: tuple[int, int, float]) -> torch.Tensor:
    tensor = tensor.clone()
    for row, col, value in spots:
        tensor[row, col] = value
    return tensor


CASES = {
    "one row": _rows(1, 384),
    "many rows": _rows(32, 384, seed=1),
    "an infinity": _with(_rows(3, 16), (1, 2, float("inf")), (2, 0, float("-inf"))),
    "a NaN": _with(_rows(3, 16), (1, 5, float("nan"))),
    "a NaN and an infinity": _with(_rows(2, 4), (0, 0, float("nan")), (1, 1, float("inf"))),
    "tiny and huge values": _with(_rows(2, 4), (0, 0, 1e-45), (1, 3, 3.4e38), (0, 1, -0.0)),
    "empty rows": torch.zeros((2, 0)),
    "no rows": torch.zeros((0, 384)),
    "a float64 model": _with(_rows(2, 8).double(), (0, 0, 1 / 3), (1, 1, 0.1)),
    "a float16 model": _rows(2, 8).half(),
    "a scalar a row": _rows(4, 1).flatten(),
    "integers": torch.arange(6).reshape(2, 3),
}


def _undated(stored: bytes) -> bytes:
    """A stored result without its JSON meta's date_done (the time it was written)."""
    return re.sub(rb'"date_done":"[^"]*"', b'"date_done":""', stored)


@pytest.mark.parametrize("case", CASES)
def test_rows_as_arrays_store_and_answer_byte_for_byte_as_their_lists(case):
    tensor = CASES[case]
    as_arrays, as_lists = output_rows(tensor), tensor.tolist()
    kept, kept_before = results.stored("j", outputs=as_arrays), \
        results.stored("j", outputs=as_lists)
    assert _undated(kept) == _undated(kept_before)
    for encoding in (None, "float", "base64"):
        assert orjson.dumps(results.outputs_of(kept, encoding)) == \
            orjson.dumps(results.outputs_of(kept_before, encoding))
    # Celery's view (AsyncResult, Flower): its serializer, both ways.
    meta = {"status": "SUCCESS", "result": {"outputs": as_arrays}, "traceback": None,
            "children": None, "date_done": None, "task_id": "j"}
    celery_kept = results._stored_meta(meta)
    assert celery_kept == results._stored_meta({**meta, "result": {"outputs": as_lists}})
    assert orjson.dumps(results._meta_of(celery_kept)) == \
        orjson.dumps(results._meta_of(results._stored_meta(
            {**meta, "result": {"outputs": as_lists}})))
    # What the job's answer would be had its outputs been encoded straight away.
    for encoding in (None, "base64"):
        assert orjson.dumps(results.encode(as_arrays, encoding), option=results.JSON_OPTIONS) \
            == orjson.dumps(results.encode(as_lists, encoding), option=results.JSON_OPTIONS)


def test_only_a_float32_matrix_comes_as_numpy_rows():
    assert all(isinstance(r, np.ndarray) and r.dtype == np.float32
               for r in output_rows(CASES["many rows"]))
    float64 = output_rows(CASES["a float64 model"])
    assert float64 == CASES["a float64 model"].tolist() and float64[0][0] == 1 / 3
    for other in ("a float16 model", "a scalar a row", "integers"):
        assert output_rows(CASES[other]) == CASES[other].tolist()


def test_a_float64_models_values_are_never_narrowed():
    kept = results.stored("j", outputs=output_rows(CASES["a float64 model"]))
    assert kept.startswith(b"{")  # JSON: float32 cannot hold 1/3 nor 0.1
    assert results.outputs_of(kept)[0][0] == 1 / 3 and results.outputs_of(kept)[1][1] == 0.1


def test_packed_rows_are_the_arrays_bytes_and_a_nan_keeps_them_json():
    rows = output_rows(CASES["many rows"])
    kept = results.stored("j", outputs=rows)
    assert kept.startswith(b"\x00") and kept.endswith(b"".join(r.tobytes() for r in rows))
    assert results.stored("j", outputs=output_rows(CASES["an infinity"])).startswith(b"\x00")
    for json_case in ("a NaN", "empty rows"):
        assert results.stored("j", outputs=output_rows(CASES[json_case])).startswith(b"{")
