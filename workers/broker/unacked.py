"""kombu's record of delivered, unacknowledged messages: the `unacked` hash (tag → [message,
exchange, routing key]) and the `unacked_index` sorted by delivery time, which any worker's
visibility sweep (`QoS.restore_visible`) reads to put a dead worker's messages back.

* `Unacked`: those facts by delivery tag, through the dispatcher's own Redis client: renew a
  lease, acknowledge, put back on its queue, record what Redis refused at fetch time. It works
  whatever state kombu's connection is in, and settles a whole batch in one round trip.
* A channel closed on a lost connection does not push back the messages this worker's
  dispatcher holds (`Broker.held`): some are running in a pool child, and requeueing them
  would run them twice. The dispatcher puts back the ones no child has started, itself
  (workers/broker/leases.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils import json

from tasks.names import list_for
from workers.broker.patch import Patch
from workers.broker.state import BrokerState

logger = logging.getLogger(__name__)

# kombu's default key names (Channel.unacked_key / unacked_index_key); make_celery keeps them.
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"

# Put a message back at the head of its queue (RPUSH: kombu pops from the right) only if its
# unacked entry is still the one read: a tag acknowledged or restored meanwhile, by anyone, is
# left alone, so a message is restored at most once. KEYS: unacked, unacked_index, queue list.
# ARGV: tag, the entry as read, the message to push.
_RESTORE = """
if redis.call('hget', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('zrem', KEYS[2], ARGV[1])
redis.call('hdel', KEYS[1], ARGV[1])
redis.call('rpush', KEYS[3], ARGV[3])
return 1
"""


class Unacked:
    """Delivered, unacknowledged messages in Redis, by delivery tag. Any Redis client will
    do; the dispatcher's own is used, so it works whatever state kombu's connection is in.
    What Redis refused to record at fetch time is in `state.unrecorded`, this process's
    only copy, until it is recorded, acknowledged or put back."""

    def __init__(self, client: Any, state: BrokerState) -> None:
        self.client = client
        self.state = state
        self._restore = client.register_script(_RESTORE)

    def record_kept(self) -> int:
        """Write the unacked records Redis refused at fetch time; returns how many are still
        waiting."""
        unrecorded = self.state.unrecorded
        kept = dict(unrecorded)
        if kept:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(UNACKED, mapping=kept)
                pipe.zadd(UNACKED_INDEX, {tag: time.time() for tag in kept})
                pipe.execute()
            for tag in kept:
                unrecorded.pop(tag, None)
        return len(unrecorded)

    def renew(self, tags: Iterable[str], now: float | None = None) -> None:
        """Push each message's visibility deadline forward: a lease. XX: never re-create an
        entry that was acknowledged or restored meanwhile."""
        tags = list(tags)
        if tags:
            stamp = time.time() if now is None else now
            self.client.zadd(UNACKED_INDEX, {t: stamp for t in tags}, xx=True)

    def ack(self, tags: Iterable[str]) -> None:
        tags = list(tags)
        if tags:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.zrem(UNACKED_INDEX, *tags)
                pipe.hdel(UNACKED, *tags)
                pipe.execute()
            for tag in tags:
                self.state.unrecorded.pop(tag, None)

    def restore(self, tags: Iterable[str]) -> int:
        """Back to the head of their queues; returns how many were still unacknowledged."""
        tags = list(tags)
        if not tags:
            return 0
        kept = self._restore_kept(tags)
        tags = [tag for tag in tags if tag not in kept]
        with self.client.pipeline(transaction=False) as pipe:
            for tag in tags:
                pipe.hget(UNACKED, tag)
            entries = pipe.execute()
        with self.client.pipeline(transaction=False) as pipe:
            # Last first: each push goes to the head, so the first of them is served first.
            for tag, raw in reversed(list(zip(tags, entries))):
                if raw is None:
                    continue
                message, exchange, routing_key = json.loads(raw)
                if exchange:  # not one of ours; kombu's own sweep knows its bindings
                    continue
                # As kombu's Channel._do_restore_message marks it.
                message.setdefault("headers", {})["redelivered"] = True
                message["properties"].setdefault("delivery_info", {})["redelivered"] = True
                self._restore(keys=[UNACKED, UNACKED_INDEX, _queue_list(message, routing_key)],
                              args=[tag, raw, json.dumps(message)], client=pipe)
            restored = sum(int(x) for x in pipe.execute())
        return restored + len(kept)

    def _restore_kept(self, tags: list[str]) -> set[str]:
        """Push back those of `tags` never recorded in Redis (this process holds the only
        copy); returns their tags."""
        unrecorded = self.state.unrecorded
        kept = {tag: unrecorded[tag] for tag in tags if tag in unrecorded}
        if kept:
            with self.client.pipeline(transaction=False) as pipe:
                for raw in reversed(list(kept.values())):
                    message, _exchange, routing_key = json.loads(raw)
                    pipe.rpush(_queue_list(message, routing_key), json.dumps(message))
                pipe.execute()
            for tag in kept:
                unrecorded.pop(tag, None)
        return set(kept)


def _queue_list(message: dict, routing_key: str) -> str:
    return list_for(routing_key, int(message["properties"].get("priority") or 0))


def release_in_memory(message: Any) -> None:
    """kombu's own bookkeeping of an acknowledged message (it frees prefetch credit), without
    its Redis round trip, which `Unacked.ack` has done for a whole batch at once. Only for a
    message of a channel that is still open."""
    channel = getattr(message, "channel", None)
    if channel is not None and not channel.closed and channel.qos is not None:
        virtual.QoS.ack(channel.qos, message.delivery_tag)


def _restore_only_what_no_one_holds(state: BrokerState) -> Callable[[Callable[..., Any]],
                                                                 Callable[..., Any]]:
    def build(restore: Callable[..., Any]) -> Callable[..., Any]:
        def restore_unacked(self: Any, client: Any = None) -> Any:
            for tag in [t for t in self._delivered if t in state.held]:
                self._delivered.pop(tag, None)
            try:
                return restore(self, client)
            except AttributeError:
                # kombu 5.7 fails this way closing a channel over a connection Redis already
                # tore down; what it could not restore comes back through the visibility sweep.
                logger.warning("broker connection already gone: unacknowledged messages stay "
                               "in Redis until their visibility timeout")

        return restore_unacked

    return build


def patches(state: BrokerState) -> list[Patch]:
    return [Patch(kombu_redis.QoS, "restore_unacked", _restore_only_what_no_one_holds(state))]
