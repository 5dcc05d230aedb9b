"""Poison and hang isolation on its own (workers/batching/isolation.py): no broker, no worker, a
fake clock."""
from __future__ import annotations

import pytest

from workers.batching.isolation import (LIMIT_FLOOR_S, UNMEASURED_LIMIT_S, CrashLoops, TimeLimits,
                               Verdict, after_lost_batch)


@pytest.mark.parametrize("timed_out", [False, True])
def test_a_lost_batch_of_several_runs_each_job_again_alone(timed_out):
    assert after_lost_batch(5, timed_out, crashes=9, max_crashes=2) is Verdict.ALONE


def test_a_lone_job_past_its_time_limit_fails_with_timeout_at_once():
    assert after_lost_batch(1, True, crashes=1, max_crashes=2) is Verdict.TIMEOUT


def test_a_lone_job_fails_as_crashed_once_it_took_down_max_children():
    assert after_lost_batch(1, False, crashes=1, max_crashes=2) is Verdict.ALONE
    assert after_lost_batch(1, False, crashes=2, max_crashes=2) is Verdict.CRASHED
    assert after_lost_batch(1, False, crashes=3, max_crashes=3) is Verdict.CRASHED


def test_a_crash_redis_could_not_count_is_never_taken_as_the_last():
    assert after_lost_batch(1, False, crashes=None, max_crashes=1) is Verdict.ALONE


def test_a_declared_time_limit_wins_over_what_was_measured():
    limits = TimeLimits({"m": 7.0})
    limits.observe("m", 100.0)
    assert limits.limit("m") == 7.0


def test_an_undeclared_limit_is_generous_until_measured_then_ten_slowest_batches():
    limits = TimeLimits({"m": 0.0})
    assert limits.limit("m") == UNMEASURED_LIMIT_S
    limits.observe("m", 0.5)
    assert limits.limit("m") == LIMIT_FLOOR_S  # 10 x 0.5 s is under the floor
    limits.observe("m", 6.0)
    limits.observe("m", 2.0)  # a quicker batch does not lower it
    assert limits.limit("m") == 60.0


def test_a_model_crash_loops_at_three_losses_within_the_window_and_recovers_after():
    now = [0.0]
    loops = CrashLoops(losses=3, window_s=300.0, clock=lambda: now[0])
    for t in (0.0, 100.0):
        now[0] = t
        loops.lost("m")
    assert not loops.looping("m") and loops.models() == []
    now[0] = 200.0
    loops.lost("m")
    assert loops.looping("m") and loops.models() == ["m"]
    assert not loops.looping("other")
    now[0] = 301.0  # the first loss left the window
    assert not loops.looping("m")
