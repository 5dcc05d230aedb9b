"""The API's result listener (app/waiter.py) on a real Redis: a batch's "done" message on the
moves channel wakes every request waiting on one of its jobs; its other moves wake only those
that follow every move; an earlier release's per-job done channel still wakes its waiters."""
from __future__ import annotations

import redis

from app.waiter import ResultWaiter


def test_a_done_message_wakes_the_waiters_of_each_job_it_names(redis_server):
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    waiter = ResultWaiter(client, max_waits=10, max_per_key=10)
    try:
        with waiter.watch("a") as a, waiter.watch("b") as b, waiter.watch("c") as c, \
                waiter.watch("d", moves=True) as d:
            assert waiter.subscribed.wait(5)
            for event in (a, b, c, d):
                event.clear()  # the wake-up every waiter gets once subscribed
            client.publish("iq:moves", "running a b d")
            assert d.wait(5) and not a.is_set() and not b.is_set()
            client.publish("iq:moves", "done a b")
            assert a.wait(5) and b.wait(5) and not c.is_set()
            client.publish("iq:done:c", "succeeded")  # a worker of an earlier release
            assert c.wait(5)
    finally:
        waiter.close()
