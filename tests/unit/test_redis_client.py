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


def _python_calls(fn) -> list[str]:
    """The Python functions `fn` runs (their names), in order."""
    import sys

    called: list[str] = []

    def profile(frame, event, _arg):
        if event == "call":
            called.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return called


SUBMIT_LIKE = ("EVALSHA", "0123abcd" * 5, 3, "iq:job:1", "iq:idem:1", "iq:q:echo",
               *(f"arg{i}" for i in range(20)), b"\x00body", 7, 1.5, memoryview(b"view"))


@pytest.mark.skipif(redis_client.COMMAND_PACKER is None, reason="hiredis is not installed")
def test_commands_are_packed_in_one_hiredis_call_as_redis_py_packs_them():
    from redis.connection import HiredisRespSerializer

    ours, theirs = redis_client.COMMAND_PACKER, HiredisRespSerializer()
    for args in (SUBMIT_LIKE, ("CLIENT SETNAME", "api"), ("SET", "k", bytearray(b"v"))):
        assert ours.pack(*args) == theirs.pack(*args)
    # redis-py splits a command's name on any whitespace, a leading or trailing one too.
    for name in ("CONFIG\tGET", "CONFIG\nGET", "CONFIG\r\nGET", "CONFIG\x0bGET",
                 "CONFIG\x0cGET", " GET", "GET\t", "CONFIG  GET"):
        assert ours.pack(name, "maxmemory") == theirs.pack(name, "maxmemory"), repr(name)
    with pytest.raises(redis.DataError):
        ours.pack("SET", "k", None)
    # The wrong type is named, as redis-py's encoder names it.
    for wrong, name in ((None, "NoneType"), ({}, "dict"), (True, "bool"), ([1], "list")):
        with pytest.raises(redis.DataError, match=f"Invalid input of type: '{name}'"):
            ours.pack("SET", "k", wrong)
    # redis-py's own pass over the arguments (a generator step each) is not taken
    assert _python_calls(lambda: ours.pack(*SUBMIT_LIKE)) == ["<lambda>", "pack"]
    assert "<genexpr>" in _python_calls(lambda: theirs.pack(*SUBMIT_LIKE))


@pytest.mark.skipif(redis_client.COMMAND_PACKER is None, reason="hiredis is not installed")
@pytest.mark.parametrize("deadline_s", [None, 1.0])
def test_every_client_packs_with_it(deadline_s):
    from config import load_settings

    client = redis_client.connect("redis://127.0.0.1:1/0", load_settings(),
                                  max_connections=4, deadline_s=deadline_s)
    connection = client.connection_pool.make_connection()
    assert connection._command_packer is redis_client.COMMAND_PACKER
