"""A worker whose lease lapsed (Redis out of its reach longer than a lease: a host cut off, a
failover) on a real Redis, through the worker's own in-flight record, dispatcher and
settlement: every job it held comes back to life exactly once, whichever of the held message
and the copy it fetched again is the one that runs.

The game day of 2026-12-04 (11:18Z) left three jobs `queued` for good this way: the start of a
held batch, retried in its pool child while Redis was away, ran the moment Redis answered and
found the messages off the worker's record (another worker had taken them back: LAPSED); the
worker's next fetch took those very messages back onto its own record, and delivered them while
the dispatcher still held the originals, so the copies were dropped as duplicates; then the
LAPSED outcome let the originals go too. The entries stayed on the live worker's record, leased
by its beat: no recovery and no reconciler looks at them."""
from __future__ import annotations

import json
from time import monotonic
from types import SimpleNamespace

import pytest
import redis

from tasks.jobstate import JobState, StartDecision
from workers.child.batch import JobOutcome, Outcome
from workers.broker import Broker, InFlight, Leases
from workers.broker.broker import Broker
from workers.batching.dispatcher import PoolDispatcher
from workers.batching.settlement import Settlement
from tests.integration.test_fetch import QUEUE, submit


@pytest.fixture
def server(redis_server):
    client = redis.Redis.from_url(redis_server.extra["admin_url"], decode_responses=True)
    client.flushdb()
    return redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)


@pytest.fixture
def broker():
    broker = Broker(lease_s=30, heartbeat_s=2).install(node="w@test")
    yield broker
    broker.uninstall()


class Held:
    """What the dispatcher and the settlement read of a job's Celery request."""

    def __init__(self, job_id: str, tag: str) -> None:
        self.id = job_id
        self.message = SimpleNamespace(delivery_tag=tag)  # a fresh object per delivery
        self.request_dict: dict = {"headers": {}}  # no token, as the record has none


def dispatcher(worker: InFlight, jobs: JobState) -> PoolDispatcher:
    """The dispatcher's intake and settlement over this worker's record (no consumer)."""
    d = PoolDispatcher.__new__(PoolDispatcher)
    d.ids = {}
    d.leases = Leases(worker)
    app = SimpleNamespace(conf=SimpleNamespace(iq_settings=SimpleNamespace(result_ttl_s=60)))
    d.settlement = Settlement(app, d.leases, jobs, limits=None)
    return d


def fetch(worker: InFlight, job_id: str) -> Held:
    """The worker's next fetch, one message: the job's."""
    got = worker.take([QUEUE], 1)
    assert got and len(got) == 1
    return Held(job_id, json.loads(got[0][1])["properties"]["delivery_tag"])


def held_then_reaped(server, broker, jobs: JobState, job_id: str):
    """This worker fetches and holds the job, then is cut off longer than a lease: it stops
    beating, and another worker takes its messages back onto their queues. Returns this
    worker's record, its dispatcher, the held delivery and the other worker's record."""
    worker = InFlight(server, broker)
    worker.beat()
    d = dispatcher(worker, jobs)
    original = fetch(worker, job_id)
    d.leases.hold(original.message)  # as the Strategy does, then the buffer, then a batch
    d.ids[job_id] = original
    server.delete(broker.alive_key)
    other = Broker(lease_s=30, heartbeat_s=2)
    other.name("other@test")
    reaper = InFlight(server, other)
    reaper.beat()
    other.lease_since = monotonic() - 31
    assert reaper.reap() == 1
    return worker, d, original, reaper


def test_a_held_job_that_lapsed_at_its_start_runs_once_after_its_copy_was_dropped(server,
                                                                                  broker):
    jobs = JobState(server)
    job_id = submit(jobs, "lapsed")
    # Held, then cut off longer than a lease: another worker takes it back onto its queue.
    worker, d, original, _ = held_then_reaped(server, broker, jobs, job_id)
    assert server.llen(QUEUE) == 1

    # Redis answers again. The held batch's start, retried in its child, runs first: the
    # message is off this worker's record, so it must not run here.
    assert jobs.start([job_id], worker="w@test/1", batch="b", tokens=[""],
                      held=(broker.inflight_key, [original.message.delivery_tag])) \
        == [StartDecision.LAPSED]
    # Then the worker beats (its lease made again) and fetches: the same message, the same
    # tag, back on its own record, delivered while the original is still held: dropped.
    assert worker.beat() is False
    copy = fetch(worker, job_id)
    assert copy.message.delivery_tag == original.message.delivery_tag
    assert d.duplicate(copy) is True
    # The batch comes back: its job lapsed.
    d.settlement.finish("m", [original], [JobOutcome(job_id, Outcome.NOT_RUN,
                                                     reason=StartDecision.LAPSED)])

    # Neither delivery runs here, so the job's message must be live somewhere: back on its
    # queue, not left on this worker's record with nobody holding it.
    assert len(d.leases) == 0
    assert server.hlen(broker.inflight_key) == 0, "the dropped copy's entry was orphaned"
    assert server.llen(QUEUE) == 1
    # Whoever fetches it next runs it, once.
    again = fetch(worker, job_id)
    d.leases.hold(again.message)
    assert jobs.start([job_id], worker="w@test/1", batch="c", tokens=[""],
                      held=(broker.inflight_key, [again.message.delivery_tag])) \
        == [StartDecision.RUN]
    assert server.hget(f"iq:job:{job_id}", "runs") == "1"


def test_a_lapsed_job_whose_message_another_worker_took_is_left_to_it(server, broker):
    jobs = JobState(server)
    job_id = submit(jobs, "taken")
    worker, d, original, taker = held_then_reaped(server, broker, jobs, job_id)
    taken = fetch(taker, job_id)  # the other worker holds it now, and runs it
    assert jobs.start([job_id], worker="w@test/1", batch="b", tokens=[""],
                      held=(broker.inflight_key, [original.message.delivery_tag])) \
        == [StartDecision.LAPSED]
    d.settlement.finish("m", [original], [JobOutcome(job_id, Outcome.NOT_RUN,
                                                     reason=StartDecision.LAPSED)])
    # Nothing put back: the one live message is the other worker's.
    assert server.llen(QUEUE) == 0
    assert server.hexists(taker.state.inflight_key, taken.message.delivery_tag)
    assert len(d.leases) == 0
