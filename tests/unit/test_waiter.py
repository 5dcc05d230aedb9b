"""The result listener of an API process, against a Redis that is not there."""
import redis

from app.waiter import ResultWaiter
from scripts.stack import free_port


def test_a_closed_waiter_wakes_its_waiters_and_stops_retrying():
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.2)
    waiter = ResultWaiter(client, max_waits=4, max_per_key=4)
    with waiter.watch("some-job") as finished:
        listener = waiter._thread
        assert listener is not None and listener.is_alive()  # retrying its Redis
        waiter.close()
        assert finished.is_set()  # a waiter is not left to time out
    assert not listener.is_alive()
    with waiter.watch("another-job"):
        assert not waiter._thread.is_alive()  # closed stays closed
