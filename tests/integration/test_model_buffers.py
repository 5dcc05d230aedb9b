"""A model that returns a view of a tensor it keeps (an output buffer it writes each call) has
each chunk's outputs stored as they were when that chunk ran: a job whose inputs span several
model calls gets each call's rows, not the last call's written over the earlier ones."""
from __future__ import annotations

from pathlib import Path

from scripts.stack import launch


def build_buffered_model(path: Path) -> Path:
    """y = 2x + 1 over 4 features, written into one output buffer that the model keeps and
    returns a view of, call after call (as a model avoiding allocations may)."""
    import torch

    class Buffered(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("out", torch.zeros(64, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            self.out[:n].copy_(x * 2 + 1)
            return self.out[:n]

    torch.jit.script(Buffered()).save(str(path))
    return path


def test_each_chunk_keeps_its_own_rows(tmp_path):
    model = {"kind": "torchscript", "path": str(build_buffered_model(tmp_path / "b.pt")),
             "input_shape": [4], "input_dtype": "float32", "max_batch_size": 2,
             "max_inputs": 6}
    stack = launch(tmp_path, {"buffered": model}, {"w": ["buffered"]})
    try:
        inputs = [[float(i)] * 4 for i in range(6)]  # three model calls of two rows
        job = stack.finished(stack.submit("buffered", inputs)["id"], timeout=120)
        assert job["status"] == "succeeded", job
        assert job["result"]["outputs"] == [[2 * i + 1.0] * 4 for i in range(6)]
    finally:
        stack.stop()
