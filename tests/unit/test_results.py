"""How outputs are written (tasks/results.py): float32 values in half the bytes, nothing
rounded, and base64 vectors on request."""
from __future__ import annotations

import base64
import random

import numpy as np
import orjson

from tasks.results import JSON_OPTIONS, compact, encode, to_base64


def embedding(dim: int = 384, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return np.asarray([rng.gauss(0, 0.05) for _ in range(dim)], dtype=np.float32).tolist()


def test_float32_values_take_about_half_the_bytes_and_come_back_exactly():
    vector = embedding()
    plain = orjson.dumps(vector)
    written = orjson.dumps(compact(vector), option=JSON_OPTIONS)
    assert len(written) < 0.6 * len(plain)
    back = np.asarray(orjson.loads(written), dtype=np.float32)
    assert np.array_equal(back, np.asarray(vector, dtype=np.float32))


def test_a_float64_value_is_never_rounded():
    values = [0.1, 1 / 3, 2.0, 1e-300]  # 0.1 and 1/3 are not float32 values
    assert orjson.loads(orjson.dumps(compact(values), option=JSON_OPTIONS)) == values
    assert orjson.loads(orjson.dumps(compact({"p": 1 / 3}), option=JSON_OPTIONS)) == {"p": 1 / 3}


def test_structure_non_numbers_and_non_finite_values_survive():
    outputs = [{"label": "a", "scores": {"a": 0.5, "b": 0.25}}, [1, 2, 3], "text",
               [float("nan"), 1.5]]
    back = orjson.loads(orjson.dumps(compact(outputs), option=JSON_OPTIONS))
    assert back == [{"label": "a", "scores": {"a": 0.5, "b": 0.25}}, [1, 2, 3], "text",
                    [None, 1.5]]


def test_base64_is_little_endian_float32():
    vector = embedding(8)
    text = to_base64(vector)
    assert len(text) == 44  # 8 values x 4 bytes, base64
    assert np.frombuffer(base64.b64decode(text), dtype="<f4").tolist() == vector
    assert encode([vector, {"not": "a vector"}], "base64") == [text, {"not": "a vector"}]


def test_float32_vectors_are_kept_packed_and_read_as_the_same_numbers_or_base64():
    from tasks.results import outputs_of, stored

    vectors = [embedding(384, 1), embedding(7, 2)]
    as_json = orjson.dumps({"result": {"outputs": compact(vectors)}}, option=JSON_OPTIONS)
    for outputs in ([vectors[0]], vectors):
        kept = stored("j", outputs=outputs)
        assert len(kept) < 4 * sum(map(len, outputs)) + 16  # 4 bytes a value
        # The numbers a reader gets are the very ones the JSON meta held, text for text.
        assert orjson.dumps(outputs_of(kept)) == orjson.dumps(compact(outputs),
                                                             option=JSON_OPTIONS)
        assert outputs_of(kept, "base64") == [to_base64(o) for o in outputs]
    assert outputs_of(as_json) == orjson.loads(orjson.dumps(compact(vectors),
                                                            option=JSON_OPTIONS))


def test_what_is_not_all_float32_vectors_stays_json():
    from tasks.results import outputs_of, stored

    for outputs in ([{"label": "a", "score": 0.5}], [[1, 2, 3]], [[0.1, 0.2]],
                    [[float("nan"), 1.5]], [embedding(4), "text"]):
        kept = stored("j", outputs=outputs)
        assert kept.startswith(b"{")
        assert outputs_of(kept) == orjson.loads(orjson.dumps(compact(outputs),
                                                             option=JSON_OPTIONS))


def test_what_packs_is_decided_by_each_values_class_as_before_the_fast_check():
    from tasks.results import stored

    packed = stored("j", outputs=[[np.float64(0.5), 1.5], [1, 2.5]])  # float subclass, int
    assert packed.startswith(b"\x00")
    for outputs in ([[True, 1.5]], [[1, 2]], [["a", 1.5]]):  # a bool, all ints, a string
        assert not stored("j", outputs=outputs).startswith(b"\x00"), outputs
