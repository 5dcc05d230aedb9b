"""Models over numeric inputs: a user's TorchScript file, and the synthetic model that stands in
for a GPU in benchmarks and fault tests."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from workers.handlers.base import Handler

_INPUT_DTYPES = {"float32": "float32", "float64": "float64", "int64": "int64"}


class TorchScriptHandler(Handler):
    """TorchScript only: `torch.jit.load` runs no pickled Python objects. Each input is a nested
    list of the declared `input_shape`; the model gets a tensor of shape (batch, *input_shape)
    and must return one row per input."""

    def initialize(self) -> None:
        import torch

        path = Path(self.spec.path)
        if not path.is_file():
            raise FileNotFoundError(f"model {self.spec.name}: no TorchScript file at {path}")
        self.model = torch.jit.load(str(path), map_location=self.device).eval()
        self.input_dtype = getattr(torch, _INPUT_DTYPES[self.spec.input_dtype])

    def warmup_inputs(self) -> list:
        import torch

        return torch.zeros((self.spec.max_batch_size, *self.spec.input_shape)).tolist()

    def preprocess(self, items: list) -> Any:
        import torch

        return torch.tensor(items, dtype=self.input_dtype, device=self.device)

    def inference(self, batch: Any) -> Any:
        return self.model(batch)

    def postprocess(self, output: Any, count: int) -> list:
        import torch

        if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != count:
            shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output)
            raise RuntimeError(f"model {self.spec.name} must return a tensor with one row per "
                               f"input ({count}); got {shape}")
        return output.detach().cpu().tolist()


FAIL_MARKER = "!fail"


class SyntheticHandler(Handler):
    """A batch of n items costs base_ms + per_item_ms * n of sleep and returns each input's
    length: a GPU-like cost curve with no CPU contention. An input equal to "!fail" makes the
    model raise, to exercise failure isolation."""

    def initialize(self) -> None:
        pass

    def warmup_inputs(self) -> list:
        return ["x"] * self.spec.max_batch_size

    def warmup(self) -> None:
        self.predict(self.warmup_inputs()[:1])  # nothing to warm; keep start-up quick

    def inference(self, batch: Any) -> Any:
        if self.spec.oom_above and len(batch) > self.spec.oom_above:
            import torch

            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory (injected above {self.spec.oom_above} items)")
        time.sleep((self.spec.base_ms + self.spec.per_item_ms * len(batch)) / 1000.0)
        if self.spec.runs_log:
            # One write with O_APPEND: lines from concurrent children never interleave.
            with open(self.spec.runs_log, "a") as log:
                log.write("".join(f"{x}\n" for x in batch))
        if FAIL_MARKER in batch:
            raise ValueError(f"synthetic model asked to fail by an input {FAIL_MARKER!r}")
        return [len(str(x)) for x in batch]
