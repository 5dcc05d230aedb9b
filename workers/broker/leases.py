"""What the dispatcher holds, and how it lets go: every message it holds, buffered in the main
process or running in a pool child, stays on this worker's in-flight hash, leased by the
worker's one heartbeat (workers/broker/inflight.py), until it is acknowledged or put back.

Acknowledging and putting back go by delivery tag through the dispatcher's own Redis client,
not through the kombu channel the message came on: they work after that channel was closed by
a reconnect, for a whole batch in one round trip. What Redis refuses (it is away) is kept and
tried again every tick; its messages stay on the in-flight hash meanwhile, leased.
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import redis
from kombu.transport import virtual

from workers.broker.inflight import InFlight

logger = logging.getLogger(__name__)


def tag_of(message: Any) -> str:
    return message.delivery_tag


def release_in_memory(message: Any) -> None:
    """kombu's own bookkeeping of a settled message (it frees prefetch credit), without a
    Redis round trip: `Leases` settled it for a whole batch at once. Only for a message of a
    channel that is still open."""
    channel = getattr(message, "channel", None)
    if channel is not None and not channel.closed and channel.qos is not None:
        virtual.QoS.ack(channel.qos, message.delivery_tag)


class Leases:
    def __init__(self, inflight: InFlight) -> None:
        self.inflight = inflight
        state = inflight.state
        # delivery tag -> the message this worker holds under it (the Broker's, which a
        # closing channel reads). A tag can come back on a newer delivery of the same message;
        # only the newest holder may settle it.
        self.held: dict[str, Any] = state.held
        self.to_ack: dict[str, Any] = state.to_ack
        self.to_restore: dict[str, Any] = state.to_restore

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, message: Any) -> None:
        self.held[tag_of(message)] = message

    def holds(self, message: Any) -> bool:
        return self.held.get(tag_of(message)) is message

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

    def ack(self, messages: Iterable[Any]) -> bool:
        """Done with these: off the in-flight hash for good (one round trip). False when Redis
        refused (they are settled on a later tick)."""
        for m in [m for m in messages if self._owned(m)]:
            self._release(m)
            self.to_ack[tag_of(m)] = m
        return self._flush()

    def restore(self, messages: Iterable[Any]) -> bool:
        """Back to the head of their queues, for any worker to take. False when Redis refused
        (they go back on a later tick)."""
        for m in [m for m in messages if self._owned(m)]:
            self._release(m)
            self.to_restore[tag_of(m)] = m
        return self._flush()

    def settled(self, messages: Iterable[Any]) -> None:
        """Acknowledged in Redis already (the finish that stored their results took them off
        the in-flight hash, tasks/jobstate.py): released here without a round trip."""
        for m in messages:
            self._release(m)

    def forget(self, messages: Iterable[Any]) -> None:
        """No longer this worker's (another took them back while its lease had lapsed):
        released without touching Redis."""
        for m in messages:
            self._release(m)

    def _flush(self) -> bool:
        try:
            if self.to_ack:
                self.inflight.ack(list(self.to_ack))
                self.to_ack.clear()
            if self.to_restore:
                self.inflight.restore(list(self.to_restore))
                self.to_restore.clear()
            return True
        except redis.RedisError as exc:
            logger.warning("Redis unavailable to settle %d message(s) (%s); they stay with "
                           "this worker and are settled when it answers",
                           len(self.to_ack) + len(self.to_restore), exc)
            return False

    def tick(self) -> None:
        """Settle what Redis refused before."""
        if self.to_ack or self.to_restore:
            self._flush()

    def snapshot(self) -> list[str]:
        """Every tag this worker is responsible for (for the watchdog's last act)."""
        for _ in range(3):
            try:
                return [*self.held, *self.to_ack, *self.to_restore]
            except RuntimeError:  # changed size while another thread read it
                continue
        return []
