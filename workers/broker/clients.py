"""The Redis clients the worker's kombu channel opens (`WorkerClients`, mixed into its channel
classes: workers/broker/fetch.py).

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

from typing import Any

from redis.backoff import NoBackoff
from redis.retry import Retry


class WorkerClients:
    """kombu's Redis channel's `_create_client` and `_connparams`, overridden: one
    synchronous client per channel pool, and no retries on the event loop's connections."""

    _worker_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._worker_client
        # A channel that reconnects gets a new pool; the cached client must follow it.
        if client is None or client.connection_pool is not self.pool:
            client = super()._create_client(asynchronous=False)
            self._worker_client = client
        return client

    def _connparams(self, asynchronous: bool = False) -> dict:
        params = super()._connparams(asynchronous=asynchronous)
        if asynchronous:  # the BRPOP and pub/sub connections the event loop reads
            params["retry"] = Retry(NoBackoff(), 0)
        return params
