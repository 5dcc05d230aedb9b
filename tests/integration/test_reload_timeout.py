"""`make reload --timeout` bounds a stall, not the whole roll (scripts/reload.py): workers that
reload in turn (workers/turns.py) take a model load each, so a reload that keeps moving on
waits past its timeout, and one where nothing moves on gives up after it. A worker here is
its report in Redis, written by the test as a worker's tick would."""
from __future__ import annotations

import threading
import time

import orjson
import pytest
import redis
import yaml

from config import load_settings
from scripts.reload import DONE, TIMED_OUT, reload
from tasks.keys import CONSUMING_KEY, MODELS_REVISION_KEY, RELOAD_STATUS_KEY

MODELS = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0}}


@pytest.fixture
def client(redis_server):
    admin = redis.Redis.from_url(redis_server.extra["admin_url"], decode_responses=True)
    admin.flushdb()
    return redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)


def report(client, revision: str, state: str, left: int = 0) -> None:
    client.zadd(CONSUMING_KEY, {"w@h": time.time()})
    client.hset(RELOAD_STATUS_KEY, "worker:w@h", orjson.dumps(
        {"revision": revision, "state": state, "at": time.time(), "children_left": left,
         "error": "", "refused": ""}))


def setup(tmp_path, client, redis_server):
    target = tmp_path / "models.yaml"
    target.write_text(yaml.safe_dump({"models": MODELS}))
    settings = load_settings({"redis_url": redis_server.extra["url"],
                              "models_file": str(target)}, environ={})
    report(client, "old", "serving")
    return settings


def test_a_reload_where_nothing_moves_on_times_out(tmp_path, client, redis_server):
    settings = setup(tmp_path, client, redis_server)
    said: list[str] = []
    started = time.monotonic()
    result = reload(timeout_s=1.5, say=said.append, settings=settings)
    assert result.status == TIMED_OUT and time.monotonic() - started < 10
    assert "nothing moved on for 1.5s" in said[-1] and "worker:w@h" in said[-1]


def test_a_reload_that_keeps_moving_on_waits_past_its_timeout(tmp_path, client, redis_server):
    settings = setup(tmp_path, client, redis_server)
    said: list[str] = []

    def worker() -> None:
        """Three children replaced, one every second: each a step the reload sees."""
        revision = None
        while revision is None or revision == "old":
            revision = client.get(MODELS_REVISION_KEY)
            time.sleep(0.1)
        for left in (3, 2, 1):
            report(client, revision, "reloading", left)
            time.sleep(1.0)
        report(client, revision, "serving")

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    started = time.monotonic()
    result = reload(timeout_s=1.5, say=said.append, settings=settings)
    thread.join(10)
    assert result.status == DONE, said
    assert time.monotonic() - started > 3, "past its 1.5 s timeout: it moved on meanwhile"
