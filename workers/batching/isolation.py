"""Poison inputs and hung calls, kept to the job that causes them. Free of Celery and Redis, so
it is tested with a fake clock (tests/unit/test_isolation.py).

* A batch whose pool child was lost (it died: a segfault, the host's out-of-memory killer; or
  it was killed at its time limit) says nothing about which of its jobs caused it: each job
  runs again alone in a batch of its own (`after_lost_batch`), where the culprit stands by
  itself and its batch-mates finish. A job that loses its child alone fails: at its time
  limit with `timeout`; by dying, once it has taken down `max_job_crashes` children (counted
  in its record, so across workers) with `crashed`. Alone is the fewest children lost for a
  single culprit: one more death, or one more time limit, whatever the batch's size.
* Every model has a time limit (`TimeLimits`): its own `time_limit_s`, else ten times the
  slowest batch this worker has seen it run (never under 30 s), or 300 s until one returned.
* A model whose children this worker lost three times within five minutes crash-loops
  (`CrashLoops`): its instances here are not counted live (/readyz, /v1/models) for as long.
"""
from __future__ import annotations

import enum
from collections import deque
from time import monotonic
from typing import Callable

# A model's time limit when it declares none: this many times its slowest batch so far, and
# never under the floor; before any batch of it returned here, the first value.
UNMEASURED_LIMIT_S = 300.0
LIMIT_FLOOR_S = 30.0
LIMIT_FACTOR = 10.0
# Children lost within the window that make a model crash-loop.
CRASH_LOOP_LOSSES = 3
CRASH_LOOP_WINDOW_S = 300.0


class Verdict(enum.Enum):
    ALONE = "alone"  # run it again, alone in its batch
    TIMEOUT = "timeout"  # fail it: it ran past its time limit alone
    CRASHED = "crashed"  # fail it: it took down max_job_crashes children, the last alone


def after_lost_batch(batch_size: int, timed_out: bool, crashes: int | None,
                     max_crashes: int) -> Verdict:
    """What becomes of one job of a batch whose child was lost. `crashes`: the children it
    has taken down so far, this one included (None: Redis could not count it)."""
    if batch_size > 1:
        return Verdict.ALONE
    if timed_out:
        return Verdict.TIMEOUT
    if crashes is not None and crashes >= max_crashes:
        return Verdict.CRASHED
    return Verdict.ALONE


class TimeLimits:
    """Each model's time limit, in this worker."""

    def __init__(self, declared: dict[str, float]) -> None:
        """`declared`: model -> its time_limit_s (0: none declared)."""
        self.declared = declared
        self.slowest: dict[str, float] = {}

    def observe(self, model: str, seconds: float) -> None:
        """A batch of `model` returned after `seconds` in the model."""
        self.slowest[model] = max(self.slowest.get(model, 0.0), seconds)

    def limit(self, model: str) -> float:
        declared = self.declared.get(model) or 0.0
        if declared:
            return declared
        if model not in self.slowest:
            return UNMEASURED_LIMIT_S
        return max(LIMIT_FLOOR_S, LIMIT_FACTOR * self.slowest[model])


class CrashLoops:
    """Children lost per model within a sliding window."""

    def __init__(self, losses: int = CRASH_LOOP_LOSSES, window_s: float = CRASH_LOOP_WINDOW_S,
                 clock: Callable[[], float] = monotonic) -> None:
        self.losses = losses
        self.window_s = window_s
        self.clock = clock
        self._lost: dict[str, deque[float]] = {}

    def lost(self, model: str) -> None:
        self._lost.setdefault(model, deque()).append(self.clock())

    def looping(self, model: str) -> bool:
        times = self._lost.get(model)
        if not times:
            return False
        while times and self.clock() - times[0] > self.window_s:
            times.popleft()
        return len(times) >= self.losses

    def models(self) -> list[str]:
        """The models that crash-loop now."""
        return [m for m in list(self._lost) if self.looping(m)]
