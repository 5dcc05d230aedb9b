"""The API's Redis client against a real, frozen (SIGSTOP) redis-server: within a request
(tasks/redis_deadline.py) its calls share one deadline, a pooled connection waited for, a new
connection's handshake, each command and pipeline included; outside one, each call has its
own, as before."""
from __future__ import annotations

import contextvars
import os
import signal
import threading
import time

import pytest
import redis

from app.store import api_client
from config import load_settings
from scripts.stack import start_redis, wait_until
from tasks import redis_deadline
from tasks.redis_client import connect

DEADLINE_S = 1.0
SLACK_S = 0.25


@pytest.fixture
def frozen(tmp_path):
    server = start_redis(tmp_path)
    settings = load_settings({"redis_url": server.extra["url"], "redis_deadline_s": DEADLINE_S})
    client = api_client(settings)
    assert client.ping()  # one connection made while it answers
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        yield settings, client
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


def timed_out(call) -> tuple[float, BaseException | None]:
    """How long `call` took, and the Redis error it raised (a timeout, or no free connection)."""
    started = time.monotonic()
    try:
        call()
    except (redis.TimeoutError, redis.ConnectionError) as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def test_a_requests_calls_share_one_deadline(frozen):
    _settings, client = frozen

    def three_reads():
        with client.pipeline(transaction=False) as pipe:
            pipe.hgetall("a")
            pipe.get("b")
            pipe.execute()

    with redis_deadline.deadline(DEADLINE_S):
        took, first = timed_out(client.ping)
        then, second = timed_out(lambda: client.get("b"))
        last, third = timed_out(three_reads)
    assert first is not None and DEADLINE_S - 0.05 < took < DEADLINE_S + SLACK_S, took
    # Nothing left: refused at once, never sent.
    assert isinstance(second, redis_deadline.DeadlinePassed) and then < 0.05
    assert isinstance(third, redis_deadline.DeadlinePassed) and last < 0.05
    # Outside a request, each call has the whole deadline of its own, as before.
    took, error = timed_out(lambda: client.get("a"))
    assert error is not None and took > DEADLINE_S - 0.05


def test_a_new_connection_and_a_pooled_wait_are_within_it(frozen):
    """A frozen Redis still completes a TCP connect (the kernel's backlog): the handshake
    (AUTH) is what does not answer. And with every connection of the pool held, the wait for
    one counts too."""
    settings, _ = frozen
    fresh = connect(settings.redis_url, settings, max_connections=1, deadline_s=DEADLINE_S)
    with redis_deadline.deadline(DEADLINE_S):
        time.sleep(0.4)  # the request's own work before its first call
        took, error = timed_out(fresh.ping)
    assert error is not None and took < DEADLINE_S - 0.4 + SLACK_S, took

    # The pool's only connection held by a call outside any request (its own deadline):
    # a request waits for it, then has nothing left for the handshake.
    pool = fresh.connection_pool
    holder = threading.Thread(target=contextvars.Context().run, args=(
        lambda: pytest.raises(redis.TimeoutError, fresh.ping),))
    holder.start()
    wait_until(lambda: pool.pool.empty(), 5, "the only connection taken")
    with redis_deadline.deadline(DEADLINE_S):
        took, error = timed_out(lambda: fresh.get("a"))
    holder.join()
    assert error is not None and took < DEADLINE_S + SLACK_S, took
