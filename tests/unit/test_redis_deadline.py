"""A request's one Redis deadline (tasks/redis_deadline.py), on a fake clock: what is left of it,
paused time not counted, shared by a fan-out's threads, and bounding DeadlineRetry's retries."""
from __future__ import annotations

import contextvars
import threading

import pytest
import redis

from tasks import redis_client, redis_deadline
from tasks.redis_deadline import Deadline, DeadlinePassed


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_what_is_left_shrinks_and_then_refuses():
    clock = Clock()
    deadline = Deadline(2.0, clock)
    assert deadline.bound(5.0) == 2.0 and deadline.bound(0.5) == 0.5
    clock.now += 1.5
    assert deadline.bound(5.0) == pytest.approx(0.5) and deadline.bound(None) == pytest.approx(0.5)
    clock.now += 0.5
    with pytest.raises(DeadlinePassed, match=r"deadline \(2s\) has passed"):
        deadline.bound(5.0)
    assert isinstance(DeadlinePassed("x"), redis.TimeoutError)  # answered as a Redis timeout


def test_paused_time_does_not_count_nested_pauses_once():
    clock = Clock()
    deadline = Deadline(2.0, clock)
    clock.now += 1.0
    with deadline.paused():
        clock.now += 30.0  # a ?wait, a slow body
        assert deadline.remaining() == pytest.approx(1.0)
        with deadline.paused():
            clock.now += 5.0
        clock.now += 5.0
    assert deadline.remaining() == pytest.approx(1.0)
    clock.now += 0.75
    assert deadline.remaining() == pytest.approx(0.25)


def test_the_threads_of_a_fan_out_share_the_requests_deadline():
    seen: list[Deadline | None] = []
    with redis_deadline.deadline(2.0) as mine:
        thread = threading.Thread(target=contextvars.copy_context().run,
                                  args=(lambda: seen.append(redis_deadline.current()),))
        thread.start()
        thread.join()
        assert redis_deadline.current() is mine
    assert seen == [mine] and redis_deadline.current() is None
    # Outside a request a timeout is left as it is, and a pause is nothing.
    assert redis_deadline.bound(7.0) == 7.0
    with redis_deadline.paused():
        pass


def test_retries_stop_where_the_request_s_deadline_does(monkeypatch):
    """A dropped connection is retried while another try fits in the call's deadline and in
    what is left of the request's: a request that spent 1.8 s of its 2 s gets no retry that
    would end past it."""
    clock = Clock()
    monkeypatch.setattr(redis_client.time, "monotonic", clock)
    monkeypatch.setattr(redis_client.time, "sleep", clock.sleep)
    calls: list[float] = []

    def do():
        calls.append(clock.now)
        clock.now += 0.05
        raise redis.ConnectionError("reset")

    request = Deadline(2.0, clock)
    token = redis_deadline._current.set(request)
    try:
        clock.now += 1.8
        with pytest.raises(redis.ConnectionError):
            redis_client.DeadlineRetry(2.0).call_with_retry(do, lambda _error: None)
    finally:
        redis_deadline._current.reset(token)
    assert calls and clock.now <= 100.0 + 2.0
