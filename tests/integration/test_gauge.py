"""The API's reading of Redis's memory and queue depths (app/gauge.py) on a real Redis: a submit
far from both limits has the script check neither, one near a limit has it check that one."""
from __future__ import annotations

import time

import pytest
import redis

from app.gauge import Gauge
from config.models import ModelSpec

QUEUES = ["gauged"]


@pytest.fixture
def admin(redis_server):
    client = redis.Redis.from_url(redis_server.extra["admin_url"], decode_responses=True)
    client.flushdb()
    yield client
    client.config_set("maxmemory", 0)


@pytest.fixture
def gauge(redis_server, admin):
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    return Gauge(client, headroom=0.1, max_age_s=0.05)


def spec(max_depth: int) -> ModelSpec:
    return ModelSpec(name="m", kind="synthetic", queue="gauged", max_queue_depth=max_depth)


def test_far_from_both_limits_neither_is_checked(gauge):
    assert gauge.limits(spec(100), QUEUES) == (None, None)


def test_the_depth_is_checked_from_half_the_limit_counting_this_process_submits(gauge, admin):
    # A reading of an empty queue: the first two of this process's submits onto it are far
    # from half of 6, the third is not, though no new reading was taken in between.
    gauge.max_age_s = 60
    assert [gauge.limits(spec(6), QUEUES)[0] for _ in range(4)] == [None, None, None, 6]
    # Messages queued by others count from the next reading on.
    gauge.max_age_s = 0.05
    admin.lpush("gauged", *["m"] * 3)
    time.sleep(0.06)
    assert gauge.limits(spec(6), QUEUES)[0] == 6
    assert gauge.limits(spec(100), QUEUES)[0] is None


def test_the_memory_is_checked_within_twice_its_headroom(gauge, admin):
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory", int(used / 0.85))  # 15% free: within 2 x 10%
    assert gauge.limits(spec(100), QUEUES)[1] == 0.1
    admin.config_set("maxmemory", int(used / 0.5))
    time.sleep(0.06)
    assert gauge.limits(spec(100), QUEUES)[1] is None


def test_without_a_reading_both_are_checked(redis_server):
    away = redis.Redis(port=1, socket_connect_timeout=0.2)  # nothing listens there
    assert Gauge(away, headroom=0.1).limits(spec(100), QUEUES) == (100, 0.1)
