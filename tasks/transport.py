"""Everything that touches Celery's or kombu's internals, in one place, each with a test in
tests/integration/test_transport.py that fails loudly if an upgrade changes what it relies on.

Installed by `make_celery` in every process that talks to the broker (`install()`):

* One Redis client per channel pool instead of one per command. kombu's `conn_or_acquire`
  builds a new `redis.Redis` for each ack, unacked-index write and event publish, and
  redis-py 8 copies its ~200 response callbacks into a fresh dict every time: a fifth of a
  worker main process's CPU under load.
* No blocking read inside the event loop after a dropped connection. kombu reads its pub/sub
  (broadcast) connection when the socket turns readable; when Redis closed it (a failover, a
  proxy restart, `CLIENT KILL`), redis-py's retry reconnects, resubscribes and then blocks
  reading the new, silent socket, with no timeout: the worker's whole event loop hangs and it
  never consumes again. With no retries on the event loop's connections the error reaches
  Celery, which reconnects the consumer properly.
* A channel closed on a lost connection does not push back the messages this worker's
  dispatcher holds (`HELD`): some are running in a pool child, and requeueing them would run
  them twice. The dispatcher puts back the ones no child has started, itself
  (workers/leases.py).
* A message is never dropped between its fetch and its record. kombu takes a message off its
  queue (BRPOP) and then records it as unacknowledged in a second command; when Redis refuses
  that one (it is full, or its connection just dropped), kombu lost the message. It is kept
  here instead (`UNRECORDED`) and handed on: `Unacked` records it, acknowledges it or puts
  it back on its queue as soon as Redis takes writes again.
* Messages waiting behind the one a BRPOP returned come with its record. kombu pays a BRPOP
  and a MULTI/ZADD/HSET/EXEC round trip for every message; here the record of the message
  BRPOP returned is one script that also takes (and records) what else waits on the same
  queues, up to the prefetch limit, in BRPOP's order (`_FETCH`). Under load, one round trip
  and one BRPOP serve a burst of messages instead of two per message.
* Task events leave in one publish per few milliseconds. Celery's worker buffers its task
  events (received, started, succeeded) and flushes them as one `task.multi` message at the
  next turn of the event loop, which under load is nearly one publish per event; here the
  flush waits up to `EVENT_FLUSH_S` (or Celery's buffer limit, 24 events), so a batch's events
  travel together. Flower and `celery events` read them as before, their timestamps unchanged.

And used directly:

* `task_message`: a Celery task message built exactly as `send_task` would publish it, for
  the API's atomic submit (tasks/jobstate.py pushes it in the same script as the job record).
* `Unacked`: kombu's record of delivered-but-unacknowledged messages (the `unacked` hash and
  the `unacked_index` sorted by delivery time, swept by `QoS.restore_visible`), by delivery
  tag: renew a lease, acknowledge, put back on its queue.
"""
from __future__ import annotations

import base64
import logging
import time
import uuid
from bisect import bisect
from typing import Any, Iterable, Mapping

import orjson
import redis
from celery import states
from celery.utils.saferepr import saferepr
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils import json
from kombu.utils.encoding import bytes_to_str
from redis.backoff import NoBackoff
from redis.retry import Retry

from tasks import results
from tasks.jobstate import QueuedMessage, Status
from tasks.names import PRIORITY_SEP, PRIORITY_STEPS
from tasks.redis_client import is_transient

logger = logging.getLogger(__name__)

# kombu's default key names (Channel.unacked_key / unacked_index_key); make_celery keeps them.
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"

# Delivery tags the worker's dispatcher holds; a channel closing must not restore them.
HELD: set[str] = set()
# Messages fetched whose unacked record Redis refused: tag -> the record kombu would have
# written ([message, exchange, routing key] as JSON). This process holds their only copy.
UNRECORDED: dict[str, str] = {}
# Delivery tags a fetch took and recorded along with another message's record (`_FETCH`).
PRERECORDED: set[str] = set()
# How long a worker's task events may wait to leave together (seconds).
EVENT_FLUSH_S = 0.01

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


def _no_retries_in_the_event_loop() -> None:
    connparams = kombu_redis.Channel._connparams

    def _connparams(self: Any, asynchronous: bool = False) -> dict:
        params = connparams(self, asynchronous=asynchronous)
        if asynchronous:  # the BRPOP and pub/sub connections the event loop reads
            params["retry"] = Retry(NoBackoff(), 0)
        return params

    kombu_redis.Channel._connparams = _connparams


def _restore_only_what_no_one_holds() -> None:
    restore = kombu_redis.QoS.restore_unacked

    def restore_unacked(self: Any, client: Any = None) -> Any:
        for tag in [t for t in self._delivered if t in HELD]:
            self._delivered.pop(tag, None)
        try:
            return restore(self, client)
        except AttributeError:
            # kombu 5.7 fails this way closing a channel over a connection Redis already tore
            # down; what it could not restore comes back through the visibility sweep.
            logger.warning("broker connection already gone: unacknowledged messages stay in "
                           "Redis until their visibility timeout")

    kombu_redis.QoS.restore_unacked = restore_unacked


def _keep_what_could_not_be_recorded() -> None:
    append = kombu_redis.QoS.append

    def append_or_keep(self: Any, message: Any, delivery_tag: str) -> Any:
        if delivery_tag in PRERECORDED:  # taken and recorded by a fetch (`_FETCH`)
            PRERECORDED.discard(delivery_tag)
            return virtual.QoS.append(self, message, delivery_tag)
        try:
            if _record_and_take_more(self, message, delivery_tag):
                return virtual.QoS.append(self, message, delivery_tag)
            return append(self, message, delivery_tag)
        except redis.RedisError as exc:
            if not is_transient(exc):
                raise
            UNRECORDED[delivery_tag] = _unacked_entry(message)
            virtual.QoS.append(self, message, delivery_tag)  # kombu's in-memory bookkeeping
            logger.warning("Redis refused to record message %s as unacknowledged (%s); this "
                           "worker keeps it until Redis takes writes again", delivery_tag, exc)

    kombu_redis.QoS.append = append_or_keep


# Fetch script. KEYS: unacked, unacked_index, then the lists BRPOP reads, in its order.
# ARGV: now, the delivery tag BRPOP returned, its unacked entry, how many more to take.
# Returns list key, message, list key, message, ... for each one taken. Each further message is
# recorded before it leaves its list (LINDEX, record, RPOP): a write Redis refuses (it is full)
# ends the taking with nothing lost.
_FETCH = """
redis.call('zadd', KEYS[2], ARGV[1], ARGV[2])
redis.call('hset', KEYS[1], ARGV[2], ARGV[3])
local out = {}
local want = tonumber(ARGV[4])
local taken = 0
for i = 3, #KEYS do
  while taken < want do
    local item = redis.call('lindex', KEYS[i], -1)
    if not item then break end
    local props = cjson.decode(item)['properties']
    local info = props['delivery_info'] or {}
    local entry = '[' .. item .. ',' .. cjson.encode(info['exchange'] or '') .. ','
      .. cjson.encode(info['routing_key'] or '') .. ']'
    local tag = props['delivery_tag']
    if type(redis.pcall('hset', KEYS[1], tag, entry)) == 'table' then return out end
    if type(redis.pcall('zadd', KEYS[2], ARGV[1], tag)) == 'table' then return out end
    redis.call('rpop', KEYS[i])
    out[#out + 1] = KEYS[i]
    out[#out + 1] = item
    taken = taken + 1
  end
end
return out
"""
# Most messages one fetch takes besides the one BRPOP returned, where no prefetch limit caps it.
FETCH_MAX = 64
_FETCH_SCRIPT_ATTR = "_iq_fetch_script"


def _fetch_what_waits_with_each_record() -> None:
    brpop_read = kombu_redis.Channel._brpop_read

    def _brpop_read(self: Any, **options: Any) -> Any:
        self._iq_fetching, self._iq_fetched = True, []
        try:
            return brpop_read(self, **options)
        finally:
            self._iq_fetching = False
            fetched, self._iq_fetched = self._iq_fetched, []
            for key, payload in fetched:  # recorded already: `append` keeps them in memory only
                self.connection._deliver(payload, key.rsplit(self.sep, 1)[0])

    kombu_redis.Channel._brpop_read = _brpop_read


def _record_and_take_more(qos: Any, message: Any, delivery_tag: str) -> bool:
    """For the message a BRPOP just returned: record it and take what waits behind it (handed
    on by `_brpop_read`), in one script. False where this does not apply."""
    channel = qos.channel
    if not getattr(channel, "_iq_fetching", False) or channel.global_keyprefix:
        return False
    queues = list(channel.active_queues)
    keys = [channel._q_for_pri(q, pri) for pri in channel.priority_steps for q in queues]
    room = qos.can_consume_max_estimate()
    want = FETCH_MAX if room is None else max(room - 1, 0)
    with channel.conn_or_acquire() as client:
        script = client.__dict__.get(_FETCH_SCRIPT_ATTR)
        if script is None:
            script = client.__dict__[_FETCH_SCRIPT_ATTR] = client.register_script(_FETCH)
        out = script(keys=[qos.unacked_key, qos.unacked_index_key, *keys],
                     args=[time.time(), delivery_tag, _unacked_entry(message), want])
    for key, item in zip(out[::2], out[1::2]):
        payload = json.loads(bytes_to_str(item))  # as kombu's own BRPOP read parses it
        PRERECORDED.add(payload["properties"]["delivery_tag"])
        channel._iq_fetched.append((bytes_to_str(key), payload))
    return True


def _unacked_entry(message: Any) -> str:
    """A fetched message's unacked record, as kombu writes it: [message, exchange, routing
    key] as JSON."""
    delivery = message.delivery_info
    return orjson.dumps([message._raw, delivery["exchange"], delivery["routing_key"]]).decode()


def _flush_task_events_every_few_ms() -> None:
    from celery.worker.consumer.consumer import Consumer

    def on_send_event_buffered(self: Any) -> None:
        if self.hub and not getattr(self, "_iq_flush_due", False):
            self._iq_flush_due = True
            self.hub.call_later(EVENT_FLUSH_S, _flush, self)

    def _flush(consumer: Any) -> None:
        consumer._iq_flush_due = False
        consumer._flush_events()

    Consumer.on_send_event_buffered = on_send_event_buffered


_installed = False


def install() -> None:
    """Apply the adjustments, once per process."""
    global _installed
    if not _installed:
        _reuse_sync_client()
        _no_retries_in_the_event_loop()
        _restore_only_what_no_one_holds()
        _keep_what_could_not_be_recorded()
        _fetch_what_waits_with_each_record()
        _flush_task_events_every_few_ms()
        _installed = True


def release_in_memory(message: Any) -> None:
    """kombu's own bookkeeping of an acknowledged message (it frees prefetch credit), without
    its Redis round trip, which `Unacked.ack` has done for a whole batch at once. Only for a
    message of a channel that is still open."""
    channel = getattr(message, "channel", None)
    if channel is not None and not channel.closed and channel.qos is not None:
        virtual.QoS.ack(channel.qos, message.delivery_tag)


def channel_is_open(message: Any) -> bool:
    channel = getattr(message, "channel", None)
    return channel is not None and not getattr(channel, "closed", True) \
        and getattr(channel, "connection", None) is not None


def list_for(queue: str, priority: int) -> str:
    """The Redis list kombu keeps a queue's messages of this priority in (Channel._q_for_pri
    with make_celery's priority steps)."""
    step = PRIORITY_STEPS[max(bisect(PRIORITY_STEPS, priority) - 1, 0)]
    return f"{queue}{PRIORITY_SEP}{step}" if step else queue


def task_message(app: Any, name: str, task_id: str, kwargs: Mapping[str, Any], *, queue: str,
                 priority: int, headers: Mapping[str, Any] | None = None,
                 summary: Mapping[str, Any] | None = None) -> QueuedMessage:
    """The message `app.send_task(name, kwargs=..., task_id=..., queue=..., priority=...)`
    would push. With `summary`, task events (Flower) show it and the body's size in place of
    the arguments themselves."""
    as_task = app.amqp.as_task_v2(task_id, name, kwargs=dict(kwargs), argsrepr="()",
                                  kwargsrepr="", ignore_result=None)  # as send_task does
    raw = orjson.dumps(as_task.body, option=results.JSON_OPTIONS)
    kwargsrepr = repr({**summary, "bytes": len(raw)}) if summary is not None \
        else saferepr(dict(kwargs), app.amqp.kwargsrepr_maxsize)
    message = as_task._replace(headers={**as_task.headers, "kwargsrepr": kwargsrepr})
    body = base64.b64encode(raw).decode()
    payload = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {**message.headers, **(headers or {})},
        "properties": {
            **message.properties,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return QueuedMessage(list_for(queue, priority), orjson.dumps(payload))


def result_meta(app: Any, job_id: str, status: Status, result: Any) -> bytes:
    """A job's result as Celery's Redis backend stores it (AsyncResult and Flower read it):
    `{"status": "SUCCESS", "result": ...}`, or FAILURE with the JobFailed exception encoded.
    Floats as tasks/results.py writes them; a NaN or infinite output is null (JSON has
    neither)."""
    backend = app.backend
    state = states.SUCCESS if status is Status.SUCCEEDED else states.FAILURE
    meta = backend._get_result_meta(result=backend.encode_result(result, state), state=state,
                                    traceback=None, request=None)
    meta["task_id"] = job_id
    return orjson.dumps(meta, option=results.JSON_OPTIONS)


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
    """Delivered, unacknowledged messages in Redis, by delivery tag: the facts kombu's
    visibility sweep reads. Any Redis client will do; this one is the dispatcher's own, so it
    works whatever state kombu's connection is in."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._restore = client.register_script(_RESTORE)

    def record_kept(self) -> int:
        """Write the unacked records Redis refused at fetch time (UNRECORDED); returns how
        many are still waiting."""
        kept = dict(UNRECORDED)
        if kept:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.hset(UNACKED, mapping=kept)
                pipe.zadd(UNACKED_INDEX, {tag: time.time() for tag in kept})
                pipe.execute()
            for tag in kept:
                UNRECORDED.pop(tag, None)
        return len(UNRECORDED)

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
                UNRECORDED.pop(tag, None)

    def restore(self, tags: Iterable[str]) -> int:
        """Back to the head of their queues; returns how many were still unacknowledged."""
        tags = list(tags)
        if not tags:
            return 0
        kept = {tag: UNRECORDED[tag] for tag in tags if tag in UNRECORDED}
        if kept:  # never recorded in Redis: this process holds the only copy
            with self.client.pipeline(transaction=False) as pipe:
                for raw in reversed(list(kept.values())):
                    message, _exchange, routing_key = json.loads(raw)
                    priority = int(message["properties"].get("priority") or 0)
                    pipe.rpush(list_for(routing_key, priority), json.dumps(message))
                pipe.execute()
            for tag in kept:
                UNRECORDED.pop(tag, None)
            tags = [tag for tag in tags if tag not in kept]
        with self.client.pipeline(transaction=False) as pipe:
            for tag in tags:
                pipe.hget(UNACKED, tag)
            entries = pipe.execute()
        restored = 0
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
                target = list_for(routing_key, int(message["properties"].get("priority") or 0))
                self._restore(keys=[UNACKED, UNACKED_INDEX, target],
                              args=[tag, raw, json.dumps(message)], client=pipe)
            restored = sum(int(x) for x in pipe.execute())
        return restored + len(kept)
