"""Handlers without a broker: failure isolation and halving a batch on CUDA out-of-memory."""
from __future__ import annotations

import torch

from config.models import ModelSpec
from tasks.errors import JobError
from workers.child.handlers.tensor import SyntheticHandler


def spec(**kw) -> ModelSpec:
    return ModelSpec(name="s", kind="synthetic", queue="s", base_ms=0, per_item_ms=0, **kw)


def test_a_failing_job_fails_alone():
    h = SyntheticHandler(spec(max_batch_size=8), "cpu")
    h.initialize()
    results = h.run([(["a"], {}), (["!fail", "b"], {}), (["ccc"], {})])
    assert results[0] == [1] and results[2] == [3]
    assert isinstance(results[1], JobError) and results[1].code == "inference_error"


class OomAbove(SyntheticHandler):
    """Raises CUDA's out-of-memory error for any chunk above `limit` items."""

    limit = 3
    calls: list[int]

    def inference(self, batch):
        self.calls.append(len(batch))
        if len(batch) > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return super().inference(batch)


def test_out_of_memory_halves_the_batch_before_failing_anything():
    h = OomAbove(spec(max_batch_size=16), "cpu")
    h.calls = []
    out = h.run([(["x"] * 10, {}), (["yy"] * 6, {})])
    assert out == [[1] * 10, [2] * 6]
    assert h.calls[:3] == [16, 8, 4] and max(h.calls[3:]) <= 3


def test_out_of_memory_halves_the_chunk_that_ran_out_not_max_batch_size():
    """The outside attack of session 13: 8 items on max_batch_size 16 ran out of memory and
    were "retried at 8"; on max_batch_size 10**11, 2 items were retried 36 times, a failed
    model call each, before the halving came down to them."""
    h = OomAbove(spec(max_batch_size=10**11), "cpu")
    h.limit = 1
    h.calls = []
    assert h.run([(["x", "y"], {})]) == [[1, 1]]
    assert h.calls == [2, 1, 1]
    h = OomAbove(spec(max_batch_size=16), "cpu")
    h.calls = []
    assert h.run([(["x"] * 8, {})]) == [[1] * 8]
    assert h.calls == [8, 4, 2, 2, 2, 2], h.calls


def test_out_of_memory_at_batch_one_fails_the_job():
    h = OomAbove(spec(max_batch_size=4), "cpu")
    h.limit = 0
    h.calls = []
    (result,) = h.run([(["x", "y"], {})])
    assert isinstance(result, JobError) and "OutOfMemoryError" in result.message


def test_a_model_returning_the_wrong_number_of_outputs_is_caught():
    class Short(SyntheticHandler):
        def inference(self, batch):
            return [0] * (len(batch) - 1)

    (result,) = Short(spec(), "cpu").run([(["a", "b"], {})])
    assert isinstance(result, JobError) and "returned 1 outputs for 2 inputs" in result.message
