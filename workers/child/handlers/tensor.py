"""Models over numeric inputs: a user's torch.export program (`.pt2`) or TorchScript file, and
the synthetic model that stands in for a GPU in benchmarks and fault tests.

Loading never unpickles arbitrary Python objects: TorchScript is read by its own restricted
unpickler; a torch.export archive is read with torch.load forced to weights_only and is refused
if it holds pickled opaque objects (exported.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from config.models import ModelSpec
from workers.child.handlers.base import Handler, output_rows
from workers.spawn import own_folder

_INPUT_DTYPES = {"float32": "float32", "float64": "float64", "int64": "int64"}


def model_file(spec: ModelSpec, what: str) -> Path:
    path = Path(spec.path)
    if not path.is_file():
        raise FileNotFoundError(f"model {spec.name}: no {what} file at {path}")
    return path


def load_program(spec: ModelSpec, device: str, input_shape: tuple[int, ...]):
    """The callable module in `spec.path`: a torch.export program for kind export (and for an
    image model whose file ends in `.pt2`), else TorchScript."""
    import torch

    if spec.kind == "export" or (spec.kind == "image" and str(spec.path).endswith(".pt2")):
        from workers.child.handlers.exported import load_exported

        return load_exported(model_file(spec, "torch.export"), device, input_shape)
    return torch.jit.load(str(model_file(spec, "TorchScript")), map_location=device).eval()


def rows_of(name: str, output: Any, count: int) -> Any:
    """The model's output checked to hold one row per input."""
    import torch

    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != count:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output)
        raise RuntimeError(f"model {name} must return a tensor with one row per "
                           f"input ({count}); got {shape}")
    return output


class TensorHandler(Handler):
    """Each input is a nested list of the declared `input_shape`; the model gets a tensor of
    shape (batch, *input_shape) and must return one row per input."""

    def initialize(self) -> None:
        import torch

        self.model = load_program(self.spec, self.device, self.spec.input_shape)
        self.input_dtype = getattr(torch, _INPUT_DTYPES[self.spec.input_dtype])

    def sample_inputs(self, count: int) -> list:
        import torch

        return torch.zeros((count, *self.spec.input_shape)).tolist()

    def preprocess(self, items: list) -> Any:
        import torch

        return torch.tensor(items, dtype=self.input_dtype, device=self.device)

    def inference(self, batch: Any) -> Any:
        return self.model(batch)

    def postprocess(self, output: Any, count: int) -> list:
        return output_rows(rows_of(self.spec.name, output, count))


TorchScriptHandler = ExportHandler = TensorHandler


FAIL_MARKER = "!fail"
CRASH_MARKER = "!crash"
HANG_MARKER = "!hang"


class SyntheticHandler(Handler):
    """A batch of n items costs base_ms + per_item_ms * n of sleep and returns each input's
    length: a GPU-like cost curve with no CPU contention. For the fault tests, an input equal
    to "!fail" makes the model raise; one that starts with "!crash" kills the model's process
    (as a segfault or the host's out-of-memory killer would), one that starts with "!hang"
    makes the call never return. While its `load_gate` file exists, a child loading it waits
    (fault tests: a replacement child that takes as long to load as they need).

    The GPU-faithful stand-in (kind keys `prepare_ms`, `output_floats`) adds the work a real
    model's child does around the device: `prepare_ms` an item of pure-Python work with the GIL
    held (as tokenising and packing a batch cost), the sleep standing for the device's time
    (it releases the GIL, as a CUDA kernel does), and per input a float32 vector of
    `output_floats` values, returned as float32 numpy rows as a real embedding model's
    postprocess returns them (base.output_rows), so that they are packed and stored as its
    are. Its device is one
    per worker, as a GPU is: children of one worker on the same device take turns on it (a
    lock file in the worker's own folder, named after the device), so a second child per
    device overlaps its work with the device's, never two devices' worth of sleep. Its
    calibration against the H200 run is in bench/README.md, "A GPU-faithful stand-in".

    It runs no torch: a child that loads only stand-ins never imports it (its start takes ~1 s
    of CPU, not ~2.7 s), and `oom_above`'s injected error imports it then."""
    runs_torch = False

    def __init__(self, spec: Any, device: str) -> None:
        super().__init__(spec, device)
        own = spec.kind_settings
        self.prepare_s = float(own.get("prepare_ms", 0.0)) / 1000.0
        self.output_floats = int(own.get("output_floats", 0))
        self.device_lock: Path | None = None
        folder = own_folder()
        if own and folder:  # the stand-in in a worker: one device per worker, whatever its
            # children; the lock in the worker's own folder (workers/spawn.py), gone with it.
            # Alone (the calibrator), it has no one to take turns with.
            self.device_lock = folder / f"standin-{device.replace(':', '')}.lock"

    def initialize(self) -> None:
        gate = Path(self.spec.load_gate) if self.spec.load_gate else None
        while gate is not None and gate.exists():
            time.sleep(0.05)

    def sample_inputs(self, count: int) -> list:
        return ["x"] * count

    def warmup(self) -> None:
        """Nothing to warm: its cost is a sleep per batch, and a warm-up call would only wait
        it out (a 40 s model would take 40 s to start)."""

    def preprocess(self, items: list) -> Any:
        if self.prepare_s:
            _hold_the_gil_for(self.prepare_s * len(items))
        return items

    def inference(self, batch: Any) -> Any:
        if self.spec.oom_above and len(batch) > self.spec.oom_above:
            import torch

            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory (injected above {self.spec.oom_above} items)")
        with self._device():
            started = time.monotonic()
            time.sleep((self.spec.base_ms + self.spec.per_item_ms * len(batch)) / 1000.0)
            self.device_span = (started, time.monotonic())
        if self.spec.runs_log:
            # One write with O_APPEND: lines from concurrent children never interleave.
            with open(self.spec.runs_log, "a") as log:
                log.write("".join(f"{x}\n" for x in batch))
        if FAIL_MARKER in batch:
            raise ValueError(f"synthetic model asked to fail by an input {FAIL_MARKER!r}")
        if any(str(x).startswith(CRASH_MARKER) for x in batch):
            os.kill(os.getpid(), signal.SIGKILL)
        if any(str(x).startswith(HANG_MARKER) for x in batch):
            threading.Event().wait()
        return [len(str(x)) for x in batch]

    @contextlib.contextmanager
    def _device(self) -> Iterator[None]:
        """The device to itself for a call (the stand-in's; the plain synthetic model has no
        lock: its fault tests' children run side by side)."""
        if self.device_lock is None:
            yield
            return
        # Read-only, and never through a link: a link planted where the lock goes (it was a
        # guessable name in the shared temporary folder) must not get a root worker to open
        # (and create) its target for writing. flock needs no write access.
        lock = os.open(self.device_lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                       0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed, or when the child dies
            yield
        finally:
            os.close(lock)

    def postprocess(self, output: Any, count: int) -> list:
        if not self.output_floats:
            return list(output)
        import numpy as np

        # Each input's vector: its length spread over the row, so that outputs differ by input
        # and a test can check one against its input.
        lengths = np.asarray(output, dtype=np.float32)[:, None]
        steps = np.arange(1, self.output_floats + 1, dtype=np.float32)[None, :]
        return list(lengths / steps)  # one 2-D float32 array's rows, as output_rows gives


def _hold_the_gil_for(seconds: float) -> None:
    """Pure-Python work for `seconds`: the interpreter holds the GIL as it runs bytecode (and
    lets other threads in at its switch interval, as it does for a tokenising loop)."""
    end = time.perf_counter() + seconds
    spins = 0
    while time.perf_counter() < end:
        spins += 1
