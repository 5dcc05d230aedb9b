"""The result listener of an API process, against a Redis that is not there."""
from app.waiter import ResultWaiter
from config.settings import Settings
from tasks.redis_client import connect


def test_a_closed_waiter_wakes_its_waiters_and_stops_retrying():
    # The API's own client, its retries bounded by redis_deadline_s (a bare redis.Redis
    # retries for up to ~7 s, longer than close() waits for the listener), at a port where
    # nothing listens (a free port could be taken by another test's Redis meanwhile).
    settings = Settings()
    client = connect("redis://127.0.0.1:1/0", settings, max_connections=4,
                     deadline_s=settings.redis_deadline_s)
    waiter = ResultWaiter(client, max_waits=4, max_per_key=4)
    with waiter.watch("some-job") as finished:
        listener = waiter._thread
        assert listener is not None and listener.is_alive()  # retrying its Redis
        waiter.close()
        assert finished.is_set()  # a waiter is not left to time out
    assert not listener.is_alive()
    with waiter.watch("another-job"):
        assert not waiter._thread.is_alive()  # closed stays closed
