"""Two adjustments to kombu's Redis transport (kombu 5.7), installed by `make_celery` in every
process that talks to the broker: the API, the workers and the benchmark's peer alike.

* One Redis client per channel pool instead of one per command. kombu's `conn_or_acquire`
  builds a new `redis.Redis` for each ack, each unacked-index write and each event publish, and
  redis-py 8 copies its ~200 response callbacks into a fresh dict every time: a fifth of a
  worker main process's CPU under load. The client holds no connection of its own (each
  command borrows one from the pool), so one per pool serves every caller, threads included.
* A worker survives closing a channel over a connection Redis already tore down. kombu then
  pushes the channel's unacknowledged messages back through that dead connection and the whole
  worker crashes ("Unrecoverable error: AttributeError: 'NoneType' object has no attribute
  'hostname'"). Those messages are still in Redis's unacked set and come back after the
  visibility timeout, so the worker may simply carry on and reconnect.
"""
from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis

logger = logging.getLogger(__name__)

_CLIENT_ATTR = "_iq_sync_client"


def _reuse_sync_client() -> None:
    create = kombu_redis.Channel._create_client

    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        if asynchronous:
            return create(self, asynchronous=True)
        client = self.__dict__.get(_CLIENT_ATTR)
        # A channel that reconnects gets a new pool; the cached client must follow it.
        if client is None or client.connection_pool is not self.pool:
            client = create(self, asynchronous=False)
            self.__dict__[_CLIENT_ATTR] = client
        return client

    kombu_redis.Channel._create_client = _create_client


def _survive_restore_on_lost_connection() -> None:
    restore = kombu_redis.QoS.restore_unacked

    def restore_unacked(self: Any, client: Any = None) -> Any:
        try:
            return restore(self, client)
        except AttributeError:
            logger.warning("broker connection already gone: unacknowledged messages stay in "
                           "Redis and are redelivered after the visibility timeout")

    kombu_redis.QoS.restore_unacked = restore_unacked


_installed = False


def install() -> None:
    """Apply both, once per process."""
    global _installed
    if not _installed:
        _reuse_sync_client()
        _survive_restore_on_lost_connection()
        _installed = True
