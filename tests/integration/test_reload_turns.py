"""A reload's turn (workers/batching/turns.py) against a real Redis: one worker at a time per
queue, taken all at once or not at all, given back only by its holder, lapsing when its holder
stops renewing it."""
from __future__ import annotations

import pytest
import redis

from scripts.stack import wait_until
from tasks.keys import reload_turn_key
from workers.batching.turns import Turn


@pytest.fixture
def client(redis_server):
    admin = redis.Redis.from_url(redis_server.extra["admin_url"], decode_responses=True)
    admin.flushdb()
    return redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)


def turn(client, worker: str, ttl_s: float = 10.0) -> Turn:
    return Turn(client, worker, ttl_s, retry_s=0.0)


def test_one_worker_at_a_time_per_queue(client):
    a, b = turn(client, "a@h"), turn(client, "b@h")
    assert a.take(["q"]) and a.held
    assert not b.take(["q"]) and b.waiting_for == "a@h" and not b.held
    assert a.take(["q"]), "its own turn, held"
    b.release()  # not b's to give back
    assert client.get(reload_turn_key("q")) == "a@h"
    a.release()
    assert not a.held and client.get(reload_turn_key("q")) is None
    assert b.take(["q"]) and b.waiting_for == ""


def test_every_queue_at_once_or_none(client):
    a, c = turn(client, "a@h"), turn(client, "c@h")
    assert a.take(["q1"])
    assert not c.take(["q2", "q1"]) and c.waiting_for == "a@h"
    assert client.get(reload_turn_key("q2")) is None, "c holds nothing while it waits"
    a.release()
    assert c.take(["q2", "q1"])
    assert {client.get(reload_turn_key(q)) for q in ("q1", "q2")} == {"c@h"}


def test_a_holder_that_stops_renewing_lapses(client):
    a = turn(client, "a@h", ttl_s=0.5)
    b = turn(client, "b@h")
    assert a.take(["q"])
    assert 0 < client.pttl(reload_turn_key("q")) <= 500
    client.pexpire(reload_turn_key("q"), 50)
    a.renew()  # a live holder's tick: its full TTL again
    assert client.pttl(reload_turn_key("q")) > 50
    # a's main process is gone: nobody renews, and b gets its turn once the key lapses.
    wait_until(lambda: b.take(["q"]), 10, "a's turn to lapse")
    a.renew()
    assert client.get(reload_turn_key("q")) == "b@h", "a renews only its own"


def test_a_refused_worker_asks_again_no_sooner_than_retry_s(client):
    a = turn(client, "a@h")
    b = Turn(client, "b@h", 10.0, retry_s=3600)
    assert a.take(["q"]) and not b.take(["q"])
    a.release()
    assert not b.take(["q"]), "not asked again yet"
    b._asked = float("-inf")
    assert b.take(["q"])


def test_a_holder_whose_keys_lapsed_learns_it_at_its_renewal(client):
    """Its event loop held past the TTL: one of its keys lapsed and another worker took it.
    It no longer counts itself the holder, and lets go of the key still its own."""
    a, b = turn(client, "a@h"), turn(client, "b@h")
    assert a.take(["q1", "q2"])
    client.delete(reload_turn_key("q1"))
    assert b.take(["q1"])
    a.renew()
    assert not a.held
    assert client.get(reload_turn_key("q1")) == "b@h"
    assert client.get(reload_turn_key("q2")) is None
