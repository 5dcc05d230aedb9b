"""A model handler's life: `initialize` (load on the child's device) → `warmup` → for every
batch `preprocess` → `inference` → `postprocess`, per chunk of at most `max_batch_size` items.

`run` is what the batch executor calls: it runs all jobs' inputs together, splits chunks in
half on CUDA out-of-memory, and isolates failures so one bad job never fails its neighbours.
"""
from __future__ import annotations

import logging
import sys
import time
from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import Any, Callable, Sequence

from config.models import ModelSpec
from tasks.errors import ErrorCode, JobError
from workers.child.handlers import busy

logger = logging.getLogger(__name__)

Job = tuple[list, dict]  # (inputs, options)
Progress = Callable[[int], None]  # told how many items are done, after each model call


def is_oom(exc: BaseException) -> bool:
    """CUDA out of memory; on the CPU, an allocation the system refused. A process that never
    imported torch (a child of the stand-in only) cannot have raised torch's."""
    torch = sys.modules.get("torch")
    if isinstance(exc, MemoryError) or (
            torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def output_rows(output: Any) -> list:
    """A model's output tensor as one output per row. A 2-D float32 tensor's rows come as
    1-D float32 numpy rows (views of one array on the host: no copy each, no Python float a
    value), which tasks/results.py stores packed as they are, byte for byte as their lists;
    any other tensor (float64, float16, integers, one value or a matrix a row) as `.tolist()`
    gives it, so that no value is narrowed or widened on the way. A tensor already on the host
    is copied once first: it may be a view of memory the model keeps and writes again at its
    next call (an output buffer), before this batch's results are stored (a job whose inputs
    span several calls had its earlier calls' rows written over by its last)."""
    import torch

    on_host = output.device.type == "cpu"
    output = output.detach().cpu()
    if output.dtype == torch.float32 and output.dim() == 2:
        rows = output.numpy()
        return list(rows.copy() if on_host else rows)  # off the host: .cpu() copied it
    return output.tolist()


class Handler(ABC):
    # False for a model that runs no torch (the synthetic stand-in): its child then never
    # imports torch for it (its device is not prepared; its calls are not in inference mode).
    runs_torch = True
    # The device's own span of the last inference (time.monotonic), where the handler knows it
    # better than the host's times around the call (the stand-in, which waits its turn on its
    # device before it runs); None: those host times (or CUDA events).
    device_span: tuple[float, float] | None = None

    def __init__(self, spec: ModelSpec, device: str) -> None:
        self.spec = spec
        self.device = device

    @abstractmethod
    def initialize(self) -> None:
        """Load the model onto self.device, in eval mode."""

    @abstractmethod
    def sample_inputs(self, count: int) -> list:
        """`count` representative inputs (warm-up, batch-size calibration)."""

    def preprocess(self, items: list) -> Any:
        return items

    @abstractmethod
    def inference(self, batch: Any) -> Any:
        """Run the model; called under torch.inference_mode()."""

    def postprocess(self, output: Any, count: int) -> list:
        return list(output)

    def finalize(self, outputs: list, options: dict) -> list:
        """Per-job shaping of the outputs (e.g. classification labels)."""
        return outputs

    # -- machinery -------------------------------------------------------------------------
    def warmup(self) -> None:
        self.predict(self.sample_inputs(self.spec.max_batch_size))

    def call(self, items: list) -> list:
        """One model call on all of `items` (no chunking): preprocess, inference,
        postprocess, one output per item checked. The inference's span on the device goes
        to the busy-share ledger (busy.py)."""
        if self.runs_torch:
            import torch

            mode = torch.inference_mode()
        else:
            mode = nullcontext()
        with mode:
            batch = self.preprocess(items)
            self.device_span = None
            timer = DeviceTimer(self.device, events=self.runs_torch)
            output = self.inference(batch)
            timer.stop(self.device_span)
            outputs = self.postprocess(output, len(items))
            timer.record(self.spec.name)
        if len(outputs) != len(items):
            raise RuntimeError(
                f"model {self.spec.name} returned {len(outputs)} outputs for {len(items)} inputs"
            )
        return outputs

    def predict(self, items: Sequence, progress: Progress | None = None) -> list:
        """All items, in chunks of at most max_batch_size; a chunk that runs out of memory
        is halved and retried before anything fails. `progress` is told how many items are
        done after each chunk."""
        items = list(items)
        size = self.spec.max_batch_size
        out: list = []
        i = 0
        while i < len(items):
            chunk = items[i:i + size]
            try:
                out.extend(self.call(chunk))
            except Exception as exc:
                if not is_oom(exc) or len(chunk) == 1:
                    raise
                # Half of what ran out, not of max_batch_size: a chunk shorter than that (the
                # batch's last, or a small batch) once "halved" to its own size, or larger.
                size = max(len(chunk) // 2, 1)
                from workers import metrics

                metrics.get().oom_splits.labels(self.spec.name).inc()
                logger.warning("out of memory on %d items of %s; retrying at %d",
                               len(chunk), self.spec.name, size)
                self.release_memory()
                continue
            i += len(chunk)
            if progress is not None:
                progress(i)
        return out

    def release_memory(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    def run(self, jobs: Sequence[Job], progress: Progress | None = None,
            waiting_since: float | None = None) -> list[list | JobError]:
        """Each job's outputs (or its error), the jobs' inputs run together; `progress` is told
        how many of their items (in order) are done after each model call. `waiting_since`:
        when the earliest of them was submitted (time.monotonic), for the busy share."""
        if waiting_since is not None:
            busy.ledger().work_waiting(self.device, waiting_since)
        flat = [item for inputs, _opts in jobs for item in inputs]
        try:
            outputs = self.predict(flat, progress)
        except Exception as exc:
            if len(jobs) == 1:
                return [self._failure(exc)]
            # Something in the batch broke the model: run each job alone so that only the
            # job at fault fails.
            logger.warning("batch of %d jobs failed on %s; retrying each alone",
                           len(jobs), self.spec.name, exc_info=True)
            return [self._run_one(job) for job in jobs]
        results: list[list | JobError] = []
        start = 0
        for inputs, options in jobs:
            chunk = outputs[start:start + len(inputs)]
            start += len(inputs)
            try:
                results.append(self.finalize(chunk, options))
            except Exception as exc:
                results.append(self._failure(exc))
        return results

    def _run_one(self, job: Job) -> list | JobError:
        inputs, options = job
        try:
            return self.finalize(self.predict(inputs), options)
        except Exception as exc:
            return self._failure(exc)

    def _failure(self, exc: BaseException) -> JobError:
        logger.warning("job failed on %s: %r", self.spec.name, exc)
        return JobError(ErrorCode.INFERENCE_ERROR, f"{type(exc).__name__}: {exc}")


class DeviceTimer:
    """A model call's span on its device: host times around the inference; on CUDA, the
    device's own time between two events recorded on the stream (read once the outputs are
    copied back, when the stream has passed them: no extra synchronisation). `events`: False
    for a handler that runs no torch (it gives its own span)."""

    def __init__(self, device: str, events: bool = True) -> None:
        self.device = device
        self.events = None
        if events and device.startswith("cuda"):
            import torch

            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start = time.monotonic()
        self.end = self.start
        self.own_span = False

    def stop(self, span: tuple[float, float] | None = None) -> None:
        """The call returned; `span`: the handler's own device span, which the events and
        the host's times give way to (the stand-in's sleep, whatever its device)."""
        if self.events is not None:
            self.events[1].record()
        self.end = time.monotonic()
        if span is not None:
            self.start, self.end = span
            self.own_span = True

    def record(self, model: str) -> None:
        device_s = None
        if self.events is not None and not self.own_span:
            self.events[1].synchronize()
            device_s = self.events[0].elapsed_time(self.events[1]) / 1000.0
            # The device ends its work after the host has queued it: its span starts where the
            # host's did (the child's stream is idle between calls) and lasts its own time.
            self.end = self.start + device_s
        busy_s, idle_s = busy.ledger().ran(model, self.device, self.start, self.end, device_s)
        from workers import metrics

        metrics.record_device(model, self.device, busy_s, idle_s,
                              busy.ledger().share(model, self.device))
