"""The application's Redis client through the sentinels (tasks/redis_client.py), against a real
primary and sentinel: a command that outlives its deadline leaves nothing behind for the
commands sent after it on the same connection. redis-py's Sentinel connections kept such a
connection, and the game day's frozen Redis made submits read other submits' answers."""
from __future__ import annotations

import redis

from config import load_settings
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
