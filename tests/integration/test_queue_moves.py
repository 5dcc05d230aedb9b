"""A reload that changes a model's queue (tasks/queuemoves.py) on a real Redis: what waits on the
old queue goes to the new one, at each priority and in order, once no worker consumes the old
one; each job's record follows it; what a worker hands back afterwards and what the reconciler
finds go to the new queue too; the depth reading counts what is not moved yet."""
from __future__ import annotations

import uuid

import orjson
import pytest
import redis

from tasks.keys import PENDING_KEY, QUEUE_MOVES_KEY, consuming_key, job_key, wake_key
from tasks.names import queue_lists
from tasks.queuemoves import QueueMoves, changed_queues
from workers.broker import InFlight
from workers.broker.broker import Broker

OLD, NEW = "iq-moves-old", "iq-moves-new"


@pytest.fixture
def server(redis_server, clean_admin):
    return redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)


def queued(server: redis.Redis, list_key: str, marker: str) -> str:
    """A job queued on `list_key` as the submit leaves it: its message there (LPUSH, the
    newest at the head) and its record naming the list."""
    job_id = str(uuid.uuid4())
    message = orjson.dumps({"headers": {"id": job_id}, "m": marker,
                            "properties": {"delivery_tag": str(uuid.uuid4())}}).decode()
    server.hset(job_key(job_id), mapping={"status": "queued", "list": list_key,
                                          "message": message})
    server.lpush(list_key, message)
    return job_id


def served(server: redis.Redis, list_key: str) -> list[str]:
    """The markers of `list_key`'s messages in the order a worker takes them (the tail
    first)."""
    return [orjson.loads(m)["m"] for m in reversed(server.lrange(list_key, 0, -1))]


def test_changed_queues_are_those_of_kept_models_whose_old_queue_is_free():
    before = {"a": "qa", "b": "qb", "c": "qc", "gone": "qg"}
    after = {"a": "qa2", "b": "qb", "c": "qa", "new": "qn"}
    # a moved off qa, but c took qa: nothing to move from it; b kept its queue; gone removed.
    assert changed_queues(before, after) == {"qc": "qa"}
    assert changed_queues({"a": "qa"}, {"a": "qa2"}) == {"qa": "qa2"}


def test_what_waits_moves_once_no_worker_consumes_the_old_queue(server):
    old_lists, new_lists = queue_lists(OLD), queue_lists(NEW)
    jobs = {step: [queued(server, old_lists[step], f"old-{step}-{i}") for i in range(3)]
            for step in range(3)}
    newer = queued(server, new_lists[0], "new-0")  # sent to the new queue since
    moves = QueueMoves(server)
    moves.record({OLD: NEW}, [NEW])

    # A worker still consumes the old queue (its beat is recent): nothing moves.
    server.zadd(consuming_key(OLD), {"w@host": float(server.time()[0])})
    (held,) = moves.move(consumer_ttl_s=10)
    assert (held.jobs, held.consumed) == (0, True)
    assert server.llen(old_lists[0]) == 3
    # Still counted for the new queue meanwhile: its depth is not 0.
    assert moves.waiting([NEW]) == {NEW: 10}

    server.delete(consuming_key(OLD))
    (moved,) = moves.move(consumer_ttl_s=10)
    assert (moved.old, moved.new, moved.jobs, moved.consumed) == (OLD, NEW, 9, False)
    assert [server.llen(name) for name in old_lists] == [0, 0, 0]
    # Each at its own priority; the older ones served first, in their order.
    assert served(server, new_lists[0]) == ["old-0-0", "old-0-1", "old-0-2", "new-0"]
    assert served(server, new_lists[2]) == ["old-2-0", "old-2-1", "old-2-2"]
    for step, ids in jobs.items():
        assert {server.hget(job_key(j), "list") for j in ids} == {new_lists[step]}
    assert server.hget(job_key(newer), "list") == new_lists[0]
    assert server.llen(wake_key(NEW)) == 1
    assert moves.waiting([NEW]) == {NEW: 10}
    (again,) = moves.move(consumer_ttl_s=10)
    assert again.jobs == 0


def test_a_queue_given_to_a_model_again_is_moved_from_no_more(server):
    moves = QueueMoves(server)
    moves.record({OLD: NEW}, [NEW])
    assert server.hgetall(QUEUE_MOVES_KEY) == {OLD: NEW}
    moves.record({NEW: OLD}, [OLD])  # moved back
    assert server.hgetall(QUEUE_MOVES_KEY) == {NEW: OLD}
    queued(server, queue_lists(OLD)[0], "stays")
    assert moves.move(consumer_ttl_s=10)[0].jobs == 0
    assert server.llen(OLD) == 1


def test_what_a_worker_hands_back_after_the_move_goes_to_the_new_queue(server):
    state = Broker(lease_s=30, heartbeat_s=2)
    state.name("w@test")
    inflight = InFlight(server, state)
    inflight.beat()
    job_id = queued(server, OLD, "buffered")
    ((_list, message),) = inflight.take([OLD], 1)
    QueueMoves(server).record({OLD: NEW}, [NEW])
    tag = orjson.loads(message)["properties"]["delivery_tag"]
    assert inflight.restore([tag]) == 1
    assert server.llen(OLD) == 0 and served(server, NEW) == ["buffered"]
    assert server.hget(job_key(job_id), "list") == NEW


def test_the_reconciler_finds_a_job_on_the_old_queue_and_requeues_a_lost_one_on_the_new(
        server):
    state = Broker(lease_s=1, heartbeat_s=1)
    state.name("w@test")
    inflight = InFlight(server, state)
    inflight.beat()
    waiting_id = queued(server, OLD, "waiting")  # not moved yet: a worker consumes OLD
    lost_id = queued(server, OLD, "lost")
    server.lrem(OLD, 1, server.hget(job_key(lost_id), "message"))  # on no list, no record
    QueueMoves(server).record({OLD: NEW}, [NEW])
    server.zadd(PENDING_KEY, {waiting_id: 0, lost_id: 0})
    assert inflight.reconcile() == [lost_id]
    assert served(server, OLD) == ["waiting"] and served(server, NEW) == ["lost"]
    assert server.hget(job_key(waiting_id), "list") == OLD  # the move relists it
    assert server.hget(job_key(lost_id), "list") == NEW
