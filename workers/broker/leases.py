"""Leases: every message a worker holds, buffered in its main process or running in a pool
child, stays invisible to the other workers for as long as this worker lives, and no longer.

kombu's Redis transport keeps each delivered message in an `unacked` hash with its delivery
time in `unacked_index`; any worker's sweep puts back the ones older than the visibility
timeout. The dispatcher renews (`tick`) the time of every message it holds, so a live worker's
messages never come back however long they wait in the buffer or run in a batch, while a dead
worker's return within about one visibility timeout.

Acknowledging and putting back go by delivery tag through this worker's own Redis client, not
through the kombu channel the message came on: they work after that channel was closed by a
reconnect, for a whole batch in one round trip. What Redis refuses (it is restarting) is kept
and tried again on the next tick, its lease renewed meanwhile.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import redis

from workers.broker.unacked import Unacked, release_in_memory

logger = logging.getLogger(__name__)


def tag_of(message: Any) -> str:
    return message.delivery_tag


class Leases:
    def __init__(self, unacked: Unacked) -> None:
        self.unacked = unacked
        # delivery tag → the message this worker holds under it (the Broker's, which a
        # closing channel reads). A tag can come back on a newer delivery of the same message;
        # only the newest holder may settle it.
        self.held: dict[str, Any] = unacked.state.held
        self.to_ack: dict[str, Any] = {}
        self.to_restore: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, message: Any) -> None:
        tag = tag_of(message)
        self.held[tag] = message

    def _owned(self, message: Any) -> bool:
        """Whether settling `message` is this holder's business: it is held, or nobody holds
        its tag (a message refused before it was held)."""
        current = self.held.get(tag_of(message))
        return current is None or current is message

    def _release(self, message: Any) -> None:
        tag = tag_of(message)
        if self.held.get(tag) is message:
            del self.held[tag]
        release_in_memory(message)

    def ack(self, messages: Iterable[Any]) -> None:
        """Done with these: remove them from Redis for good (one round trip)."""
        mine = [m for m in messages if self._owned(m)]
        for m in mine:
            self._release(m)
            self.to_ack[tag_of(m)] = m
        self._flush()

    def restore(self, messages: Iterable[Any]) -> None:
        """Back to the head of their queues, for any worker to take."""
        mine = [m for m in messages if self._owned(m)]
        for m in mine:
            self._release(m)
            self.to_restore[tag_of(m)] = m
        self._flush()

    def _flush(self) -> None:
        try:
            if self.to_ack:
                self.unacked.ack(list(self.to_ack))
                self.to_ack.clear()
            if self.to_restore:
                self.unacked.restore(list(self.to_restore))
                self.to_restore.clear()
        except redis.RedisError as exc:
            logger.warning("Redis unavailable to settle %d message(s) (%s); retrying",
                           len(self.to_ack) + len(self.to_restore), exc)

    def tick(self) -> None:
        """Record what Redis refused to record at fetch time, settle what it refused before,
        and renew every lease this worker holds."""
        try:
            self.unacked.record_kept()
        except redis.RedisError as exc:
            logger.warning("Redis still refuses to record %d fetched message(s): %s",
                           len(self.unacked.state.unrecorded), exc)
        self._flush()
        try:
            self.unacked.renew([*self.held, *self.to_ack, *self.to_restore])
        except redis.RedisError as exc:
            logger.warning("could not renew %d lease(s): %s", len(self.held), exc)

    def snapshot(self) -> list[str]:
        """Every tag this worker is responsible for (for the watchdog's last act)."""
        for _ in range(3):
            try:
                return [*self.held, *self.to_ack, *self.to_restore]
            except RuntimeError:  # changed size while another thread read it
                continue
        return []
