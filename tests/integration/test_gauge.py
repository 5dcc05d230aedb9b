"""The API's reading of its queues' depths (app/gauge.py) on a real Redis: a submit far from
max_queue_depth has the script leave the depth unchecked, one near it has it check it; the
memory headroom is checked on every submit."""
from __future__ import annotations

import uuid

import pytest
import redis

from app.gauge import Gauge
from app.store import api_client
from config import load_settings
from config.models import ModelSpec
from scripts.stack import wait_until
from tasks.jobstate import JobState, Overloaded, new_job
from tasks.messages import QueuedMessage

QUEUES = ["gauged"]


@pytest.fixture
def admin(clean_admin):
    return clean_admin


@pytest.fixture
def gauge(redis_server, admin):
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    return Gauge(client, headroom=0.1, max_age_s=0.05)


def spec(max_depth: int) -> ModelSpec:
    return ModelSpec(name="m", kind="synthetic", queue="gauged", max_queue_depth=max_depth)


def read_now(gauge: Gauge, max_age_s: float = 60) -> None:
    """A new reading taken (on the gauge's thread) and landed, to serve for `max_age_s`."""
    gauge.max_age_s, before = 0, gauge._reading
    gauge.limits(spec(1_000_000), QUEUES)
    wait_until(lambda: gauge._reading is not before and not gauge._lock.locked(), 5,
               "the gauge's reading")
    gauge.max_age_s = max_age_s


def test_without_a_reading_the_depth_is_checked_and_one_is_taken_apart(gauge):
    assert gauge.limits(spec(100), QUEUES) == (100, 0.1)  # none yet: started, not waited for
    wait_until(lambda: gauge._reading is not None, 5, "the gauge's reading")
    assert gauge.limits(spec(100), QUEUES) == (None, 0.1)  # far from the depth limit


def test_the_depth_is_checked_from_half_the_limit_counting_this_process_submits(gauge, admin):
    # A reading of an empty queue: the first three of this process's submits onto it are far
    # from half of 6, the fourth is not, though no new reading was taken in between.
    read_now(gauge)
    assert [gauge.limits(spec(6), QUEUES)[0] for _ in range(4)] == [None, None, None, 6]
    # Messages queued by others count from the next reading on.
    admin.lpush("gauged", *["m"] * 3)
    read_now(gauge)
    assert gauge.limits(spec(6), QUEUES)[0] == 6
    assert gauge.limits(spec(100), QUEUES)[0] is None


def test_the_memory_headroom_is_checked_on_every_submit_however_far_from_full(gauge, admin):
    # A reading a second old let one API process fill a small Redis past its headroom, and a
    # worker could not even start (its first commands refused): the headroom is no soft limit.
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", int(used / 0.1))  # 90% free
    read_now(gauge)
    assert gauge.limits(spec(100), QUEUES) == (None, 0.1)


def test_a_reading_too_old_or_failed_checks_the_depth(gauge):
    read_now(gauge, max_age_s=0.05)
    gauge._reading.taken -= 0.25  # five times its age: too old to serve while the next is taken
    # The API's own client (its retries bounded by redis_deadline_s), where nothing listens.
    # A bare redis.Redis retried for up to ~7 s and outlasted the wait below (CI, stop 35).
    settings = load_settings({"redis_url": "redis://127.0.0.1:1/0"}, environ={})
    gauge.client = api_client(settings)
    assert gauge.limits(spec(100), QUEUES) == (100, 0.1)
    wait_until(lambda: not gauge._lock.locked(), 2 * settings.redis_deadline_s + 5,
               "the failed reading")
    assert gauge._reading is None and gauge.limits(spec(100), QUEUES) == (100, 0.1)


def test_a_burst_through_several_api_processes_stays_within_the_documented_bound(redis_server,
                                                                                  admin):
    # Four API processes, each with its reading of the empty queue, and a burst from all of
    # them within its age: each lets half the limit through unchecked, then the script
    # checks it, exactly (README, Reliability: up to P x max_queue_depth / 2).
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    state, limit = JobState(client, keep_s=60, ttl_s=600), 40
    gauges = [Gauge(client, headroom=0.1, max_age_s=60) for _ in range(4)]
    for one in gauges:
        read_now(one)
    admitted = 0
    for i in range(400):
        depth, headroom = gauges[i % 4].limits(spec(limit), QUEUES)
        record = new_job(str(uuid.uuid4()), model="m", trace_id="t", inputs=1,
                         priority="normal", owner="")
        try:
            state.submit(record, QueuedMessage("gauged", b"{}"), depth_lists=QUEUES,
                         max_depth=depth, ttl_s=600, memory_headroom=headroom)
            admitted += 1
        except Overloaded:
            pass
    assert admitted == client.llen("gauged") == 4 * limit // 2
    # The next reading sees the queue past half its limit: every process checks it.
    for one in gauges:
        read_now(one)
        assert one.limits(spec(limit), QUEUES)[0] == limit
