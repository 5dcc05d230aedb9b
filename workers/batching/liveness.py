"""The worker's periodic tick, on its event loop (`heartbeat_interval_s`): what Redis refused to
settle or store settled, its watchdog fed, its consuming announced to the API (`/readyz`),
queue by queue, the models it must not be counted live for marked (crash-looping children, a
batch past its time limit), and the queues it consumes checked against its models file. (Its
lease beats on the event loop too: workers/broker/fetch.py.)"""
from __future__ import annotations

import logging
from typing import Any, Callable

import redis

from tasks.keys import CONSUMING_KEY, consuming_key
from tasks.names import queue_lists
from tasks.presence import Presence
from workers.broker import Leases
from workers.batching.watchdog import Watchdog

logger = logging.getLogger(__name__)


class Liveness:
    """One per worker (`PoolDispatcher.liveness`). The dispatcher's to say: `idle`, whether a
    pool child is free and nothing waits in the buffer; `unhealthy`, the models not to be
    counted live here; `also`, its own work every tick."""

    def __init__(self, consumer: Any, client: redis.Redis, leases: Leases,
                 idle: Callable[[], bool], also: Callable[[], None],
                 unhealthy: Callable[[], list[str]]) -> None:
        self.consumer = consumer
        self.settings = consumer.app.conf.iq_settings
        self.client = client
        self.presence = Presence(client)
        self.leases = leases
        self.idle = idle
        self.also = also
        self.unhealthy = unhealthy
        self.consuming = False
        self.announced: set[str] = set()  # the queues last announced as consumed
        self.watchdog = Watchdog(self.settings.watchdog_s, self)

    def tick(self) -> None:
        self.leases.tick()
        self.also()
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
        if queues:
            self._mark_unhealthy()

    def _announce(self, queues: list[str]) -> None:
        """This worker consumes `queues` now, and no longer those it announced before: the
        API counts its instances of a model only while it consumes the model's queue."""
        host = self.consumer.hostname
        try:
            self.presence.consuming(host, queues, self.announced - set(queues),
                                    6 * self.settings.heartbeat_ttl_s)
            self.announced = set(queues)
        except redis.RedisError as exc:
            logger.warning("could not announce this worker as consuming: %s", exc)

    def _mark_unhealthy(self) -> None:
        sick = self.unhealthy()
        if not sick:
            return
        try:
            # Until a while after the last tick that found it so.
            self.presence.unhealthy(sick, self.consumer.hostname, self.settings.heartbeat_ttl_s)
        except redis.RedisError as exc:
            logger.warning("could not mark %s not live here: %s", ", ".join(sick), exc)

    def _queues(self, known: bool) -> list[str]:
        task_consumer = getattr(self.consumer, "task_consumer", None)
        conf = self.consumer.app.conf
        # A model a reload removed keeps its queue until the worker stops: its jobs fail
        # there with `model_removed` (workers/batching/reload.py).
        removed = getattr(conf, "iq_removed_models", None) or {}
        models = {spec.queue for spec in [*conf.iq_models.values(), *removed.values()]}
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
