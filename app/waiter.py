"""Wakes `?wait` requests when their job finishes, from one subscription per API process.

Every move of a job to a terminal status is announced on its done channel
(tasks/jobstate.py), with the status only. One listener thread pattern-subscribes to those
channels and sets the Event of whichever requests wait on that job: no connection per waiting
request, no subscription left behind.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Iterator

import redis

from tasks.keys import DONE_PREFIX

logger = logging.getLogger(__name__)

PREFIX = DONE_PREFIX


class ResultWaiter:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._waiters: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.subscribed = threading.Event()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._listen, name="iq-result-waiter",
                                                daemon=True)
                self._thread.start()

    def _listen(self) -> None:
        backoff = 0.1
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.psubscribe(PREFIX + "*")
                while True:
                    message = pubsub.get_message(timeout=1.0)
                    # psubscribe's confirmation has been read once get_message returns.
                    self.subscribed.set()
                    backoff = 0.1
                    if message is None:
                        continue
                    job_id = str(message["channel"])[len(PREFIX):]
                    with self._lock:
                        events = list(self._waiters.get(job_id, ()))
                    for event in events:
                        event.set()
            except redis.RedisError as exc:
                self.subscribed.clear()
                logger.warning("result listener lost Redis (%s); reconnecting", exc)
                threading.Event().wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    pubsub.close()
                except redis.RedisError:
                    pass

    @contextmanager
    def watch(self, job_id: str) -> Iterator[threading.Event]:
        """An Event set when a result is stored for `job_id`, for the `with` block's life."""
        self._start()
        event = threading.Event()
        with self._lock:
            self._waiters.setdefault(job_id, set()).add(event)
        try:
            yield event
        finally:
            with self._lock:
                waiters = self._waiters.get(job_id)
                if waiters is not None:
                    waiters.discard(event)
                    if not waiters:
                        del self._waiters[job_id]
