"""The device's busy share, from the child's own timings: of the wall time during which work was
waiting for a device, the share the device spent running a model call.

Each model call on a device is a span (its start, its end, the device's own time within it: on
CUDA, CUDA events; elsewhere the call's time). The time between a device's previous call and
this one counts as idle only from the moment work was waiting for it: the earliest submission
among the jobs of the batch being run (a batch's later chunks have waited since the first), and
never before the previous call ended. So an idle device with an empty queue lowers nothing,
and a device that waits while its child starts, prepares, stores and reports does.

    busy share = device time / (device time + idle time while work waited)

Counted per model and device (counters, whose rates Grafana divides) and, as a gauge, over the
last `WINDOW_S` seconds of the child's calls. Nothing here touches CUDA: the caller measures.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

WINDOW_S = 30.0


@dataclass
class _Span:
    end: float
    busy: float
    idle: float


@dataclass
class _Window:
    """A model's calls on a device over the last window_s, with their sums kept as calls come
    and go (a share is read after every call: never a walk over thousands of calls)."""
    spans: deque = field(default_factory=deque)
    busy: float = 0.0
    idle: float = 0.0

    def add(self, span: _Span) -> None:
        self.spans.append(span)
        self.busy += span.busy
        self.idle += span.idle

    def forget_before(self, when: float) -> None:
        while self.spans and self.spans[0].end < when:
            old = self.spans.popleft()
            self.busy -= old.busy
            self.idle -= old.idle
        if not self.spans:
            self.busy = self.idle = 0.0  # no float dust left over


@dataclass
class DeviceLedger:
    """One child's calls, per device. `clock` is time.monotonic (a fake clock in tests)."""
    clock: Callable[[], float] = time.monotonic
    window_s: float = WINDOW_S
    _last_end: dict[str, float] = field(default_factory=dict)
    _waiting_since: dict[str, float] = field(default_factory=dict)
    _windows: dict[tuple[str, str], _Window] = field(default_factory=dict)

    def work_waiting(self, device: str, since: float) -> None:
        """Work for `device` has waited since `since` (this clock's time): the batch about to
        run, its earliest job's submission."""
        self._waiting_since[device] = since

    def ran(self, model: str, device: str, start: float, end: float,
            device_s: float | None = None) -> tuple[float, float]:
        """A call of `model` on `device` from `start` to `end` (this clock's times), the device
        busy for `device_s` of it (None: all of it); its (busy, idle while work waited)
        seconds."""
        busy = max(end - start if device_s is None else min(device_s, end - start), 0.0)
        last = self._last_end.get(device)
        waited_from = self._waiting_since.get(device, start)
        if last is not None:
            waited_from = max(waited_from, last)
        idle = max(start - waited_from, 0.0)
        # Later calls of the same batch: its work has waited since this call ended.
        self._last_end[device] = end
        self._waiting_since[device] = end
        window = self._windows.setdefault((model, device), _Window())
        window.add(_Span(end, busy, idle))
        window.forget_before(end - self.window_s)
        return busy, idle

    def share(self, model: str, device: str) -> float | None:
        """The busy share of `model` on `device` over the window (None: no call in it)."""
        window = self._windows.get((model, device))
        if window is None:
            return None
        window.forget_before(self.clock() - self.window_s)
        total = window.busy + window.idle
        return window.busy / total if total > 0 else None


_ledger = DeviceLedger()


def ledger() -> DeviceLedger:
    """This process's ledger."""
    return _ledger


def monotonic_of(wall: float, now_wall: float | None = None,
                 now_mono: float | None = None) -> float:
    """A wall-clock time (a job's `submitted_at`, stamped by the API) on this process's
    monotonic clock; never later than now (a skewed clock cannot make work wait in future)."""
    now_wall = time.time() if now_wall is None else now_wall
    now_mono = time.monotonic() if now_mono is None else now_mono
    return now_mono - max(now_wall - wall, 0.0)
