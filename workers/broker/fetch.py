"""The worker's fetch: a kombu Redis channel whose messages are never off a queue without being
on this worker's in-flight record (workers/broker/lua.py).

kombu pops a message (BRPOP) and records it as unacknowledged in a second command: a reply lost
on the wire (a network cut), a worker killed between the two, or a Redis that refuses the
second (it is full) loses the message for good. Here one script (FETCH) moves what waits, up
to the prefetch room, from the queue lists onto the worker's in-flight hash, in the order a
BRPOP would serve them: a reply lost with its connection leaves the messages on the hash,
where this worker finds them again once it reconnects (`InFlight.recover`) or another worker
takes them back once this one stopped beating (`InFlight.reap`). When nothing waits, the
channel blocks on the queues' wake-up lists (BRPOP with kombu's one-second timeout): a token
is added by whoever puts a message on an empty queue, so an idle worker fetches at once, and a
token lost costs a poll, never a message.

The channel is kombu's own (plain or Sentinel: `ReliableChannel`, `ReliableSentinelChannel`),
its client and connection the ones kombu made, so the fetch works over any Redis the channel
reaches. Each message still reaches Celery's consumer as a kombu message, so every job stays a
Celery task: a fetch's messages in one call where the queue's consumer takes several at once
(the worker's: workers/broker/intake.py), else one at a time through kombu's own callbacks
(`_deliver`). The worker's transports open these channels (workers/broker/
transport.py), which a worker's main process selects when it starts (workers/broker/attach.py).
"""
from __future__ import annotations

import logging
from queue import Empty
from time import monotonic
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils import json as kombu_json
from kombu.utils.encoding import bytes_to_str

from tasks.keys import delayed_key, wake_key
from tasks.redis_client import SentinelConnection, SentinelSSLConnection
from workers.broker.clients import WorkerClients
from workers.broker.decode import readable, tag_in
from workers.broker.inflight import InFlight, fetch_call, fetched
from workers.broker.lua import MALFORMED_KEY
from workers.broker.broker import Broker, installed

logger = logging.getLogger(__name__)

# Most messages one fetch takes where no prefetch limit caps it.
FETCH_MAX = 64
# While every pool child holds a batch (`Broker.children_busy`), how long the fetch after a
# wake-up waits, so that it takes what arrives meanwhile in one round trip instead of a wake-up
# and a fetch for each message or two (seconds). Jobs fetched in that time could not run sooner;
# a child that frees and finds the buffer empty ends the wait at once.
FETCH_HOLD_S = 0.005


def _wake_loop() -> None:
    """A timer's callback: the event loop turns, and the held fetch goes."""


def _state() -> Broker:
    state = installed()
    if state is None:
        raise RuntimeError("the worker's fetch runs only with its Broker installed")
    return state


class ReliableQoS(kombu_redis.QoS):
    """kombu's books of delivered messages, over the in-flight hash: FETCH recorded each
    message already, an acknowledgement takes it off, a requeue puts it back on its queue."""

    def append(self, message: Any, delivery_tag: str) -> None:
        virtual.QoS.append(self, message, delivery_tag)  # recorded by FETCH: memory only

    def can_consume(self) -> bool:
        """kombu's prefetch limit, and nothing while the worker does not fetch
        (`Broker.fetching`): no fetch is sent, and the wake-up wait in flight is left
        unread. A fetch in flight is read still: its messages are off their queues already,
        and the dispatcher puts back what it cannot run."""
        channel = self.channel
        if channel._iq_consuming and not (channel._in_poll and channel._iq_reply == "fetch"):
            state = _state()
            if not state.fetching:
                return False
            if channel._iq_hold_until:  # a wake-up came while every child was busy
                if state.children_busy and monotonic() < channel._iq_hold_until:
                    return False
                channel._iq_hold_until = 0.0
        return super().can_consume()

    def ack(self, delivery_tag: str) -> None:
        self.channel.inflight.ack([delivery_tag])
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.channel.inflight.restore([delivery_tag])
        else:
            self.channel.inflight.ack([delivery_tag])
        virtual.QoS.ack(self, delivery_tag)

    def restore_unacked(self, client: Any = None) -> list:
        """A closing channel puts back what this worker has no use for; what the dispatcher
        holds (some of it running in a pool child) stays on the in-flight hash: requeueing it
        would run it twice."""
        self._flush()
        known = self.channel.known_tags()
        tags = [tag for tag in self._delivered if tag not in known]
        self._delivered.clear()
        try:
            self.channel.inflight.restore(tags)
        except redis.RedisError as exc:
            logger.warning("could not put back %d message(s) on closing (%s): they stay with "
                           "this worker until it reconnects, or another takes them back",
                           len(tags), exc)
        return []

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """kombu's periodic sweep (every `unacked_restore_interval`): the recovery of what
        stopped workers held, and the reconciler."""
        inflight = self.channel.inflight
        try:
            inflight.reap()
            inflight.reconcile()
        except redis.RedisError as exc:
            logger.warning("recovery of stopped workers' messages postponed: %s", exc)


class ReliableFetch:
    """The fetch, mixed into kombu's Redis channel classes."""

    QoS = ReliableQoS
    # What the command in flight on the polling connection is: 'fetch' (FETCH), 'wake' (a
    # BRPOP on the wake-up lists), or None (kombu's own BRPOP, for queues read without
    # acknowledgement: replies to control commands).
    _iq_reply: str | None = None
    _iq_want = 0
    _iq_waiting = False
    _iq_hold_until = 0.0  # monotonic: no fetch before, while every child is busy
    _iq_consuming = False
    _iq_inflight: InFlight | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._iq_noack: set[str] = set()
        # queue -> the callback its consumer gave `basic_consume` (a kombu `Consumer`'s).
        self._iq_callbacks: dict[str, Any] = {}
        super().__init__(*args, **kwargs)
        if self.global_keyprefix:
            raise ValueError("the worker's fetch (workers/broker/fetch.py) does not support "
                             "kombu's global_keyprefix")

    @property
    def inflight(self) -> InFlight:
        """This worker's in-flight record, through the channel's own (synchronous) client.
        On a channel that closes after kombu closed its transport (a Sentinel connection does
        so when it fails over to its next sentinel), no pool can be built again: the last
        client serves, its pool reconnecting (to the primary the sentinels name now)."""
        if self._iq_inflight is not None and self.connection.client is None:
            return self._iq_inflight
        client = self._create_client()
        if self._iq_inflight is None or self._iq_inflight.client is not client:
            self._iq_inflight = InFlight(client, _state())
        return self._iq_inflight

    def known_tags(self) -> set[str]:
        """What this process still has a use for, this connection's deliveries included."""
        tags = _state().known_tags()
        for channel in list(self.connection.cycle._channels):
            qos = getattr(channel, "_qos", None)
            if qos is not None and channel is not self:
                tags.update(qos._delivered)
        return tags

    # -- consuming -----------------------------------------------------------------------
    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        acked = [q for q in self.active_queues if q not in self._iq_noack]
        if (no_ack and acked) or (not no_ack and self._iq_noack & set(self.active_queues)):
            raise ValueError("one channel cannot consume queues both with and without "
                             "acknowledgement (workers/broker/fetch.py)")
        if no_ack:
            self._iq_noack.add(queue)
        elif not self._iq_consuming:
            # The first queue this channel consumes: the lease first (a message taken onto
            # the record is recovered only while its worker is registered), then what an
            # earlier connection took and never delivered goes back.
            self.inflight.beat()
            self.inflight.recover()
            self.inflight.load_fetch()
            self._iq_consuming = True
        out = super().basic_consume(queue, no_ack, *args, **kwargs)
        callback = args[0] if args else kwargs.get("callback")
        if no_ack:
            self._iq_callbacks.pop(queue, None)
        else:
            self._iq_callbacks[queue] = callback
        return out

    def _basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        out = super()._basic_cancel(consumer_tag)
        if queue is not None and queue not in self.active_queues:
            self._iq_noack.discard(queue)
            self._iq_callbacks.pop(queue, None)
        return out

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        if no_ack:
            return super().basic_get(queue, no_ack=True, **kwargs)
        lists = [self._q_for_pri(queue, pri) for pri in self.priority_steps]
        got = self.inflight.take(lists, 1, self._delayed([queue]))
        if got is None:
            self.inflight.beat()
            got = self.inflight.take(lists, 1, self._delayed([queue]))
        read = self._readable(got or [])
        if not read:
            return None
        message = self.Message(read[0][1], channel=self)
        self.qos.append(message, message.delivery_tag)
        return message

    def _delayed(self, queues: list[str]) -> list[str]:
        delayed = _state().delayed_queues
        return [delayed_key(q) for q in queues if q in delayed]

    def _brpop_start(self, timeout: Any = None) -> None:
        if self.active_queues and set(self.active_queues) <= self._iq_noack:
            self._iq_reply = None
            return super()._brpop_start(timeout)
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        if self._iq_waiting:
            command = ["BRPOP", *(wake_key(q) for q in queues), timeout or self.brpop_timeout]
            self._iq_reply = "wake"
        else:
            room = self.qos.can_consume_max_estimate()
            self._iq_want = FETCH_MAX if room is None else min(max(room, 1), FETCH_MAX)
            lists = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
            keys, args = fetch_call(_state(), lists, self._iq_want, self._delayed(queues))
            command = ["EVALSHA", self.inflight.fetch_sha(), len(keys), *keys, *args]
            self._iq_reply = "fetch"
        self._in_poll = self.client.connection
        self._brpop_sent_at = monotonic()
        self.client.connection.send_command(*command)

    def _brpop_read(self, **options: Any) -> Any:
        kind, self._iq_reply = self._iq_reply, None
        if kind is None:
            return super()._brpop_read(**options)
        woken = False
        try:
            reply = self._iq_read(kind, **options)
            if kind == "wake":
                self._iq_waiting = False  # a token, or a second gone by: look again
                self._hold_fetch()
                woken = True
                raise Empty()
            got = fetched(reply)
            if got is None:  # no lease (it lapsed, or was never taken): beat, then fetch
                self.inflight.beat()
                raise Empty()
            self._iq_waiting = len(got) < self._iq_want
            return self._iq_deliver(got)
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()
            if woken:
                self._fetch_now()

    def _fetch_now(self) -> None:
        """After a wake-up, the fetch sent at once, not at the event loop's next turn, whose
        timers (a task events' flush, the lease's beat: Redis round trips) and ticks would go
        first while the job that woke it waits; unless the fetch is held (`_hold_fetch`) or
        the QoS refuses it, as the loop's tick would not send it either (kombu's tick sends
        nothing while a command is in flight: `_in_poll`)."""
        if self._closing or not self.active_queues or not self.qos.can_consume():
            return
        self._brpop_start()

    def _hold_fetch(self) -> None:
        """After a wake-up while every pool child is busy, the fetch waits `FETCH_HOLD_S`
        (`ReliableQoS.can_consume`), the event loop woken at its end."""
        loop = getattr(self.connection, "_iq_loop", None)
        if loop is None or not _state().children_busy:
            return
        self._iq_hold_until = monotonic() + FETCH_HOLD_S
        loop.call_later(FETCH_HOLD_S, _wake_loop)

    def _iq_read(self, kind: str, **options: Any) -> Any:
        try:
            return self.client.parse_response(self.client.connection,
                                              "EVALSHA" if kind == "fetch" else "BRPOP",
                                              **options)
        except self.connection_errors:
            self.client.connection.disconnect()
            raise
        except redis.exceptions.NoScriptError:
            self.inflight.load_fetch()  # Redis restarted, or its scripts were flushed
            raise Empty() from None
        except redis.ResponseError as exc:
            # Not the message's fault nor the connection's: wait a poll before the next try.
            logger.warning("fetch refused by Redis: %s", exc)
            self._iq_waiting = True
            raise Empty() from None

    def _readable(self, got: list[tuple[str, str]]) -> list[tuple[str, Any]]:
        """The fetched messages the worker can read, (list, envelope); any other is put aside
        (`InFlight.put_aside`): one whose tag the fetch found by its text but that is not JSON
        after all, or names another tag in its properties."""
        out = []
        for list_key, raw in got:
            read, found = readable(raw), tag_in(raw)
            if read is not None and found in (None, read[1]):
                out.append((list_key, read[0]))
            elif found is not None:
                logger.error("a message on %s that is not a task message was put aside on "
                             "%s: %.200s", list_key, MALFORMED_KEY, raw)
                self.inflight.put_aside(found, raw)
            else:
                logger.error("a message on %s the worker cannot read stays on its in-flight "
                             "record: %.200s", list_key, raw)
        return out

    def _iq_deliver(self, got: list[tuple[str, str]]) -> bool:
        read = self._readable(got)
        if not read:
            raise Empty()
        if self._closing:
            # Read on close: not for Celery any more; back to the queues at once.
            self.inflight.restore([m["properties"]["delivery_tag"] for _l, m in read])
            raise Empty()
        together: dict[Any, list] = {}  # a consumer's `many` -> its messages, in order
        takers: dict[str, tuple[Any, Any, Any]] = {}  # queue -> callback, consumer, many
        for list_key, raw in read:
            queue = list_key.rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(queue)
            taker = takers.get(queue)
            if taker is None:
                taker = takers[queue] = self._iq_taker(queue)
            callback, consumer, many = taker
            if many is None:  # kombu's own way: its channel's callback, one message
                self.connection._deliver(raw, queue)
                continue
            message = self._iq_built(list_key, raw, consumer)
            if message is None:
                continue
            if message.errors:  # kombu's consumer reports it (Celery: on_decode_error)
                callback(message)
            else:
                together.setdefault(many, []).append(message)
        for many, messages in together.items():
            many(messages)  # the worker's consumer (workers/broker/intake.py)
        return True

    def _iq_taker(self, queue: str) -> tuple[Any, Any, Any]:
        """The queue's callback (a kombu `Consumer`'s), its consumer, and the consumer's
        handler's `many` (None: the consumer takes messages one at a time)."""
        callback = self._iq_callbacks.get(queue)
        consumer = getattr(callback, "__self__", None)
        return callback, consumer, getattr(getattr(consumer, "on_message", None), "many", None)

    def _iq_built(self, list_key: str, raw: Any, consumer: Any) -> Any:
        """`_iq_message`, or None for an envelope kombu cannot make a message of (headers
        not a mapping, a body its encoding does not decode: pushed onto the queue by hand),
        put aside as `_readable` puts aside what it cannot read: raised, it would stop the
        worker, and the message, recovered, stop the next one."""
        try:
            return self._iq_message(raw, consumer)
        except Exception as exc:  # anything kombu's Message raises on such an envelope
            text = kombu_json.dumps(raw)
            logger.error("a message on %s that is not a task message (%r) was put aside on "
                         "%s: %.200s", list_key, exc, MALFORMED_KEY, text)
            self.inflight.put_aside(raw["properties"]["delivery_tag"], text)
            return None

    def _iq_message(self, raw: Any, consumer: Any) -> Any:
        """A fetched message as kombu's channel and consumer hand it on (`basic_consume`'s
        callback, then kombu `Consumer`'s), its delivery recorded in kombu's books."""
        message = self.Message(raw, channel=self)
        self.qos.append(message, message.delivery_tag)
        if consumer.accept is not None:
            message.accept = consumer.accept
        return message


class ReliableChannel(ReliableFetch, WorkerClients, kombu_redis.Channel):
    """kombu's Redis channel with the worker's fetch and clients."""


class ReliableSentinelChannel(ReliableFetch, WorkerClients, kombu_redis.SentinelChannel):
    """kombu's Redis Sentinel channel with the worker's fetch, on connections dropped when a
    read fails (tasks/redis_client.SentinelConnection: redis-py's Sentinel connections keep
    a timed-out reply for the next command)."""
    connection_class = SentinelConnection
    connection_class_ssl = SentinelSSLConnection
