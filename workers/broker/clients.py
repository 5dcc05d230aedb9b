"""The Redis clients kombu's channel opens.

* One client per channel pool instead of one per command. kombu's `conn_or_acquire` builds a
  new `redis.Redis` for each ack, unacked-index write and event publish, and redis-py 8
  copies its ~200 response callbacks into a fresh dict every time: a fifth of a worker main
  process's CPU under load.
* No blocking read inside the event loop after a dropped connection. kombu reads its pub/sub
  (broadcast) connection when the socket turns readable; when Redis closed it (a failover, a
  proxy restart, `CLIENT KILL`), redis-py's retry reconnects, resubscribes and then blocks
  reading the new, silent socket, with no timeout: the worker's whole event loop hangs and it
  never consumes again. With no retries on the event loop's connections the error reaches
  Celery, which reconnects the consumer properly.
"""
from __future__ import annotations

from typing import Any, Callable

from kombu.transport import redis as kombu_redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.broker.patch import Patch

_CLIENT_ATTR = "_iq_sync_client"


def _reuse_sync_client(create: Callable[..., Any]) -> Callable[..., Any]:
    def _create_client(self: Any, asynchronous: bool = False) -> Any:
        if asynchronous:
            return create(self, asynchronous=True)
        client = self.__dict__.get(_CLIENT_ATTR)
        # A channel that reconnects gets a new pool; the cached client must follow it.
        if client is None or client.connection_pool is not self.pool:
            client = create(self, asynchronous=False)
            self.__dict__[_CLIENT_ATTR] = client
        return client

    return _create_client


def _no_retries_in_the_event_loop(connparams: Callable[..., dict]) -> Callable[..., dict]:
    def _connparams(self: Any, asynchronous: bool = False) -> dict:
        params = connparams(self, asynchronous=asynchronous)
        if asynchronous:  # the BRPOP and pub/sub connections the event loop reads
            params["retry"] = Retry(NoBackoff(), 0)
        return params

    return _connparams


def patches() -> list[Patch]:
    return [Patch(kombu_redis.Channel, "_create_client", _reuse_sync_client),
            Patch(kombu_redis.Channel, "_connparams", _no_retries_in_the_event_loop)]
