"""The device's busy share from the child's own timings (workers/child/handlers/busy.py), on a fake
clock: idle counts only while work waited for the device."""
from __future__ import annotations

import pytest

from workers.child.handlers.busy import DeviceLedger, monotonic_of


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_back_to_back_calls_keep_the_device_busy():
    ledger = DeviceLedger(clock=Clock())
    for start in (0.0, 10.0, 20.0):
        ledger.work_waiting("cuda:0", 100 + max(start - 5.0, 0.0))  # queued while it ran
        assert ledger.ran("m", "cuda:0", 100 + start, 110 + start) == (10.0, 0.0)
    ledger.clock.now = 130.0
    assert ledger.share("m", "cuda:0") == 1.0


def test_a_gap_while_work_waited_is_idle_and_lowers_the_share():
    ledger = DeviceLedger(clock=Clock())
    ledger.ran("m", "cuda:0", 100.0, 106.0)
    # The next batch's jobs waited from 104 on: the device sat idle from 106 (its last call's
    # end) to 111 while they did, as the child stored, reported and started the next batch.
    ledger.work_waiting("cuda:0", 104.0)
    assert ledger.ran("m", "cuda:0", 111.0, 117.0) == (6.0, 5.0)
    ledger.clock.now = 117.0
    assert ledger.share("m", "cuda:0") == pytest.approx(12 / 17)


def test_an_idle_device_with_nothing_waiting_is_not_counted_idle():
    ledger = DeviceLedger(clock=Clock())
    ledger.ran("m", "cpu", 100.0, 101.0)
    ledger.work_waiting("cpu", 150.0)  # nothing waited from 101 to 150
    assert ledger.ran("m", "cpu", 152.0, 153.0) == (1.0, 2.0)


def test_a_batchs_later_chunks_have_waited_since_the_previous_chunk():
    ledger = DeviceLedger(clock=Clock())
    ledger.work_waiting("cuda:0", 99.0)
    assert ledger.ran("m", "cuda:0", 100.0, 104.0) == (4.0, 1.0)
    assert ledger.ran("m", "cuda:0", 105.0, 109.0) == (4.0, 1.0)  # chunk 2: 1 s between


def test_cuda_events_time_stands_for_the_device_and_the_window_forgets_old_calls():
    ledger = DeviceLedger(clock=Clock(), window_s=30.0)
    assert ledger.ran("m", "cuda:0", 100.0, 110.0, device_s=4.0) == (4.0, 0.0)
    ledger.clock.now = 200.0
    assert ledger.share("m", "cuda:0") is None
    assert ledger.share("other", "cuda:0") is None


def test_a_submission_time_from_a_skewed_clock_never_lies_in_the_future():
    assert monotonic_of(wall=1_000.0, now_wall=990.0, now_mono=50.0) == 50.0
    assert monotonic_of(wall=985.0, now_wall=990.0, now_mono=50.0) == 45.0


def test_the_share_is_of_the_last_window_only():
    ledger = DeviceLedger(clock=Clock(), window_s=30.0)
    for i in range(60):  # a minute of back-to-back calls of 1 s
        ledger.work_waiting("cpu", 100.0 + i)
        ledger.ran("m", "cpu", 100.0 + i, 101.0 + i)
    for i in range(30):  # then half a minute of calls of 0.5 s with 0.5 s gaps while work waited
        start = 160.5 + i
        ledger.work_waiting("cpu", start - 1.0)
        ledger.ran("m", "cpu", start, start + 0.5)
    ledger.clock.now = 190.0
    assert ledger.share("m", "cpu") == pytest.approx(0.5, abs=0.02)
