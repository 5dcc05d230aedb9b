"""The result listener of an API process, against a Redis that is not there."""
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
