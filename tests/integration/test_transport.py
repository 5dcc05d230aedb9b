"""kombu's Redis transport as make_celery adjusts it (tasks/transport.py), on a real Redis."""
from __future__ import annotations

import kombu
import pytest
import redis

from tasks import transport
from tests.support.services import start_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("transport"))
    yield server.extra["url"]
    server.stop()


def test_a_channel_reuses_one_client_and_follows_a_new_pool(redis_url):
    transport.install()
    with kombu.Connection(redis_url) as conn:
        channel = conn.default_channel
        with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
            assert first is second
            assert first.connection_pool is channel.pool
        # As after a reconnect: the channel's pools are replaced, and the client with them.
        channel._disconnect_pools()
        with channel.conn_or_acquire() as renewed:
            assert renewed is not first
            assert renewed.connection_pool is channel.pool
            assert renewed.ping()


def test_messages_still_flow_and_acks_clear_the_unacked_index(redis_url):
    transport.install()
    queue = kombu.Queue("iq-transport-test")
    with kombu.Connection(redis_url) as conn:
        conn.Producer().publish({"n": 1}, routing_key=queue.name, declare=[queue],
                                serializer="json")
        message = queue(conn.default_channel).get(no_ack=False)
        assert message is not None and message.payload == {"n": 1}
        server = redis.Redis.from_url(redis_url)
        assert server.hlen("unacked") == 1
        message.ack()
        assert server.hlen("unacked") == 0
        assert server.zcard("unacked_index") == 0
