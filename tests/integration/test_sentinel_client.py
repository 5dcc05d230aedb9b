"""The application's Redis client through the sentinels (tasks/redis_client.py), against a real
primary and sentinel: a command that outlives its deadline leaves nothing behind for the
commands sent after it on the same connection. redis-py's Sentinel connections kept such a
connection, and the game day's frozen Redis made submits read other submits' answers. And the
primary looked up again after a failover, a sentinel frozen, fits in the request's deadline."""
from __future__ import annotations

import os
import signal
import threading
import time

import redis
import yaml

from app import create_app
from config import Settings, load_settings
from scripts.redis_nodes import start_group
from tasks.redis_client import connect

# A script that holds Redis for one to two seconds (Redis answers nothing meanwhile, as when
# frozen) and then answers with words no other command here returns.
SLOW = """
local stop = redis.call('time')[1] + 2
while tonumber(redis.call('time')[1]) < stop do end
return 'the slow script answers'
"""


def test_a_command_past_its_deadline_leaves_no_answer_for_the_next(tmp_path):
    group = start_group(tmp_path, replicas=0, sentinels=1)
    try:
        settings = load_settings({"redis_url": group.primary.extra["url"]},
                                 environ=group.env())
        # One connection, so that the next command goes where the slow one went.
        client = connect(settings.redis_url, settings, max_connections=1, deadline_s=0.5)
        client.set("k", "its own value")
        try:
            client.eval(SLOW, 0)
            raise AssertionError("the slow script answered within the deadline")
        except redis.TimeoutError:
            pass
        # Redis answers again once the script is done: a PING on a connection of its own
        # waits for that (Redis runs one command at a time).
        assert redis.Redis.from_url(group.primary.extra["url"]).ping()
        answers = [client.get("k") for _ in range(3)]
        assert answers == ["its own value"] * 3, answers
        assert client.ping() is True
    finally:
        group.stop()


def test_the_primary_asked_for_after_a_failover_fits_in_the_requests_deadline(tmp_path,
                                                                             monkeypatch):
    """The API on the default settings (its request deadline, 2 s), its Redis found through
    one sentinel. The primary goes (SIGKILL) and the sentinel is frozen (SIGSTOP) while a
    submit is in flight, most of its deadline spent on its own work: the submit's first call
    finds its connection dropped, and its client asks the sentinel again. The answer is a 503
    naming the job store (Redis) within the deadline. (Before: the sentinel was asked with its
    own socket timeout, a second here, whatever was left of the deadline: 2.6 s.)"""
    group = start_group(tmp_path, replicas=0, sentinels=1)
    app = None
    try:
        for name, value in group.env().items():
            monkeypatch.setenv(name, value)
        models = tmp_path / "models.yaml"
        models.write_text(yaml.safe_dump({"models": {"echo": {"kind": "synthetic"}}}))
        app = create_app({"redis_url": group.primary.extra["url"], "models_file": str(models),
                          "redis_wait_replicas": 0})  # no replica here to hold a copy
        deadline_s = Settings.redis_deadline_s
        assert app.extensions["iq.submitter"].settings.redis_deadline_s == deadline_s
        in_flight, go_on = threading.Event(), threading.Event()

        @app.before_request
        def its_own_work() -> None:  # inside the request's deadline, before any Redis call
            if in_flight.is_set():
                go_on.wait(30)
                time.sleep(deadline_s * 0.8)

        client = app.test_client()
        job = {"model": "echo", "inputs": ["a"]}
        first = client.post("/v1/jobs", json=job)
        assert first.status_code == 202, first.get_json()  # the primary found
        answer: dict = {}

        def submit() -> None:
            started = time.monotonic()
            answer["response"] = client.post("/v1/jobs", json=job)
            answer["took"] = time.monotonic() - started

        in_flight.set()
        thread = threading.Thread(target=submit)
        thread.start()
        os.kill(group.sentinels[0].proc.pid, signal.SIGSTOP)
        group.primary.proc.kill()
        group.primary.proc.wait(10)
        go_on.set()
        thread.join(30)
        response = answer["response"]
        assert response.status_code == 503, response.get_json()
        assert "the job store (Redis)" in response.get_json()["error"]["message"]
        assert answer["took"] < deadline_s + 0.3, answer["took"]
    finally:
        if app is not None:
            app.extensions["iq.store"].waiter.close()
        os.kill(group.sentinels[0].proc.pid, signal.SIGCONT)
        group.stop()
