"""The API's Redis retries are bounded by its deadline (fake clock): a dropped connection is
retried while the call is younger than the deadline, a timeout never."""
from __future__ import annotations

import pytest
import redis

from tasks import redis_client
from tasks.redis_client import DeadlineRetry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(redis_client.time, "monotonic", fake.monotonic)
    monkeypatch.setattr(redis_client.time, "sleep", fake.sleep)
    return fake


def failing(clock: Clock, error: Exception, cost_s: float, then: int | None = None):
    """A call that takes `cost_s` of the clock and fails with `error`: `then` times before it
    answers, or always (None). Returns it and the times it was called at."""
    calls: list[float] = []

    def do():
        calls.append(clock.now)
        clock.now += cost_s
        if then is not None and len(calls) > then:
            return "ok"
        raise error

    return do, calls


def test_a_refused_connection_is_retried_until_the_deadline_then_raised(clock):
    do, calls = failing(clock, redis.ConnectionError("refused"), cost_s=0.01)
    with pytest.raises(redis.ConnectionError, match="refused"):
        DeadlineRetry(2.0).call_with_retry(do, lambda _error: None)
    assert len(calls) > 3  # retried, with backoff...
    assert clock.now <= 2.0 + 0.01  # ...but never past the deadline
    assert max(clock.slept) <= 0.5


def test_a_dropped_connection_that_comes_back_is_answered(clock):
    do, calls = failing(clock, redis.ConnectionError("reset"), cost_s=0.0, then=2)
    failures: list[int] = []
    assert DeadlineRetry(2.0).call_with_retry(do, lambda _e, n: failures.append(n),
                                              with_failure_count=True) == "ok"
    assert len(calls) == 3 and failures == [1, 2]


def test_a_timeout_is_never_retried(clock):
    """It spent the deadline already, and the command may have run: sending it again could
    run it twice."""
    do, calls = failing(clock, redis.TimeoutError("Timeout reading from socket"), cost_s=2.0)
    with pytest.raises(redis.TimeoutError):
        DeadlineRetry(2.0).call_with_retry(do, lambda _error: None)
    assert len(calls) == 1 and clock.now == 2.0


def test_a_slow_failure_leaves_no_time_for_another_try(clock):
    do, calls = failing(clock, redis.ConnectionError("reset"), cost_s=1.9)
    with pytest.raises(redis.ConnectionError):
        DeadlineRetry(2.0).call_with_retry(do, lambda _error: None)
    assert len(calls) == 1
