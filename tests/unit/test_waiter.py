"""The result listener of an API process, against a Redis that is not there."""
import threading

import pytest

from app.store import api_client
from app.waiter import ResultWaiter
from config import load_settings


def test_a_closed_waiter_wakes_its_waiters_and_stops_retrying():
    # The API's own client, its retries bounded by redis_deadline_s (a bare redis.Redis
    # retries for up to ~7 s, longer than close() waits for the listener), at a port where
    # nothing listens (a free port could be taken by another test's Redis meanwhile).
    client = api_client(load_settings({"redis_url": "redis://127.0.0.1:1/0"}, environ={}))
    waiter = ResultWaiter(client, max_waits=4, max_per_key=4)
    with waiter.watch("some-job") as finished:
        listener = waiter._thread
        assert listener is not None and listener.is_alive()  # retrying its Redis
        waiter.close()
        assert finished.is_set()  # a waiter is not left to time out
    assert not listener.is_alive()
    with waiter.watch("another-job"):
        assert not waiter._thread.is_alive()  # closed stays closed


def test_a_wait_does_not_ask_whether_the_listener_thread_is_alive(monkeypatch):
    """Under gevent, `Thread.is_alive` tries a lock without waiting and, failing while the
    listener runs, yields to the hub: the waiter keeps its own flag instead."""
    client = api_client(load_settings({"redis_url": "redis://127.0.0.1:1/0"}, environ={}))
    waiter = ResultWaiter(client, max_waits=4, max_per_key=4)
    try:
        with waiter.watch("first"):  # starts the listener
            pass
        asked = []
        monkeypatch.setattr(threading.Thread, "is_alive",
                            lambda self: asked.append(self) or True)
        for job in ("a", "b", "c"):
            with waiter.watch(job):
                pass
        assert asked == []
    finally:
        monkeypatch.undo()
        waiter.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_listener_ended_by_an_error_is_started_again_by_the_next_wait():
    client = api_client(load_settings({"redis_url": "redis://127.0.0.1:1/0"}, environ={}))
    waiter = ResultWaiter(client, max_waits=4, max_per_key=4)
    listening = waiter._listen
    ended = threading.Event()

    def broken() -> None:
        ended.set()
        raise RuntimeError("not a Redis error: the listener's thread ends")

    waiter._listen = broken  # type: ignore[method-assign]
    try:
        with waiter.watch("first"):
            first = waiter._thread
        assert ended.wait(10)
        first.join(10)
        waiter._listen = listening  # type: ignore[method-assign]
        with waiter.watch("second"):
            assert waiter._thread is not first and waiter._thread.is_alive()
    finally:
        waiter.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_listener_ended_by_an_error_wakes_the_parked_waits_to_read_for_themselves():
    """Once the listener is gone no message wakes a parked wait: it is woken, and told (by
    `subscribed` cleared) to read its job every second rather than sleep to its wait's end."""
    client = api_client(load_settings({"redis_url": "redis://127.0.0.1:1/0"}, environ={}))
    waiter = ResultWaiter(client, max_waits=4, max_per_key=4)
    go = threading.Event()

    def broken() -> None:
        waiter.subscribed.set()  # as if it had subscribed
        go.wait(10)
        raise RuntimeError("not a Redis error: the listener's thread ends")

    waiter._listen = broken  # type: ignore[method-assign]
    try:
        with waiter.watch("parked") as finished:
            assert waiter.subscribed.wait(10)
            go.set()
            assert finished.wait(10), "the parked wait was not woken"
            waiter._thread.join(10)
            assert not waiter.subscribed.is_set()
    finally:
        waiter.close()
