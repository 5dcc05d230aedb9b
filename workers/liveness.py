"""The worker's periodic tick, on its event loop (`heartbeat_interval_s`): its leases renewed,
its watchdog fed, its consuming announced to the API (`/readyz`), queue by queue, and the
queues it consumes checked against its models file."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import redis

from tasks.keys import CONSUMING_KEY, consuming_key
from tasks.names import queue_lists
from workers.broker import Leases
from workers.watchdog import Watchdog

logger = logging.getLogger(__name__)


class Liveness:
    """One per worker (`PoolDispatcher.liveness`). `idle`: whether a pool child is free and
    nothing waits in the buffer (the dispatcher's to say)."""

    def __init__(self, consumer: Any, client: redis.Redis, leases: Leases,
                 idle: Callable[[], bool]) -> None:
        self.consumer = consumer
        self.settings = consumer.app.conf.iq_settings
        self.client = client
        self.leases = leases
        self.idle = idle
        self.consuming = False
        self.announced: set[str] = set()  # the queues last announced as consumed
        self.watchdog = Watchdog(self.settings.watchdog_s, self)

    def tick(self) -> None:
        self.leases.tick()
        self.watchdog.beat()
        for queue in self.unknown_queues():  # added at run time (`control add_consumer`)
            logger.error("queue %s belongs to no model in %s: stopped consuming it, so that "
                         "its jobs wait for a worker that has the model", queue,
                         self.settings.models_file)
            self.consumer.cancel_task_queue(queue)
        queues = self.consumed_queues()
        if queues:  # else no model's queue (a webhooks-only worker, or all cancelled)
            self.watchdog.observe_idle_with_work(self.idle() and self._jobs_waiting(queues))
        if self.consuming and (queues or self.announced):
            self._announce(queues)

    def _announce(self, queues: list[str]) -> None:
        """This worker consumes `queues` now, and no longer those it announced before: the
        API counts its instances of a model only while it consumes the model's queue."""
        host, now = self.consumer.hostname, time.time()
        try:
            with self.client.pipeline(transaction=False) as pipe:
                if queues:
                    pipe.zadd(CONSUMING_KEY, {host: now})
                for queue in queues:
                    pipe.zadd(consuming_key(queue), {host: now})
                for queue in self.announced - set(queues):
                    pipe.zrem(consuming_key(queue), host)
                pipe.execute()
            self.announced = set(queues)
        except redis.RedisError as exc:
            logger.warning("could not announce this worker as consuming: %s", exc)

    def _queues(self, known: bool) -> list[str]:
        task_consumer = getattr(self.consumer, "task_consumer", None)
        models = {spec.queue for spec in self.consumer.app.conf.iq_models.values()}
        return [q.name for q in (task_consumer.queues if task_consumer else [])
                if (q.name in models) is known]

    def unknown_queues(self) -> list[str]:
        """Queues this worker consumes that no model of its models file uses: Celery would
        take their messages as unregistered tasks and drop them."""
        return sorted(self._queues(known=False))

    def consumed_queues(self) -> list[str]:
        """The model queues this worker consumes now (`add_consumer`/`cancel_consumer` change
        them at run time)."""
        return self._queues(known=True)

    def _jobs_waiting(self, queues: list[str]) -> bool:
        """Whether any of these queues has messages waiting in Redis."""
        lists = [name for q in queues for name in queue_lists(q)]
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for name in lists:
                    pipe.llen(name)
                return sum(pipe.execute()) > 0
        except redis.RedisError:
            return False

    def start_consuming(self) -> None:
        self.consuming = True
        self.tick()
        self.watchdog.start()

    def stop_consuming(self) -> None:
        self.watchdog.pause()
        self.consuming = False
        host = self.consumer.hostname
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.zrem(CONSUMING_KEY, host)
                for queue in self.announced:
                    pipe.zrem(consuming_key(queue), host)
                pipe.execute()
            self.announced = set()
        except redis.RedisError:
            pass

    def pool_pids(self) -> list[int]:
        try:
            return list(self.consumer.pool.info.get("processes") or [])
        except Exception:  # noqa: BLE001 - the pool may be half torn down
            return []
