"""How a fetched message becomes this worker's: kombu takes it off its queue (BRPOP), then
records it as delivered but unacknowledged (the `unacked` hash and `unacked_index`).

* A message is never dropped between its fetch and its record. kombu records it in a second
  command; when Redis refuses that one (it is full, or its connection just dropped), kombu lost
  the message. It is kept instead (`Broker.unrecorded`) and handed on: `Unacked` records it,
  acknowledges it or puts it back on its queue as soon as Redis takes writes again.
* Messages waiting behind the one a BRPOP returned come with its record. kombu pays a BRPOP
  and a MULTI/ZADD/HSET/EXEC round trip for every message; here the record of the message
  BRPOP returned is one script that also takes (and records) what else waits on the same
  queues, up to the prefetch limit, in BRPOP's order (`FETCH`). Under load, one round trip
  and one BRPOP serve a burst of messages instead of two per message.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import orjson
import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils import json
from kombu.utils.encoding import bytes_to_str

from tasks.redis_client import is_transient
from workers.broker.patch import Patch
from workers.broker.state import BrokerState

logger = logging.getLogger(__name__)

# Fetch script. KEYS: unacked, unacked_index, then the lists BRPOP reads, in its order.
# ARGV: now, the delivery tag BRPOP returned, its unacked entry, how many more to take.
# Returns list key, message, list key, message, ... for each one taken. Each further message is
# recorded before it leaves its list (LINDEX, record, RPOP): a write Redis refuses (it is full)
# ends the taking with nothing lost.
FETCH = """
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
_SCRIPT_ATTR = "_iq_fetch_script"


def unacked_entry(message: Any) -> str:
    """A fetched message's unacked record, as kombu writes it: [message, exchange, routing
    key] as JSON."""
    delivery = message.delivery_info
    return orjson.dumps([message._raw, delivery["exchange"], delivery["routing_key"]]).decode()


def _take_what_waits_with_each_read(brpop_read: Callable[..., Any]) -> Callable[..., Any]:
    """BRPOP's reply is read with what the record script took behind it (`_record_and_take`),
    each then delivered as if BRPOP had returned it."""
    def _brpop_read(self: Any, **options: Any) -> Any:
        self._iq_fetching, self._iq_fetched = True, []
        try:
            return brpop_read(self, **options)
        finally:
            self._iq_fetching = False
            fetched, self._iq_fetched = self._iq_fetched, []
            for key, payload in fetched:  # recorded already: `append` keeps them in memory only
                self.connection._deliver(payload, key.rsplit(self.sep, 1)[0])

    return _brpop_read


def _record_or_keep(state: BrokerState) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def build(append: Callable[..., Any]) -> Callable[..., Any]:
        def append_or_keep(self: Any, message: Any, delivery_tag: str) -> Any:
            if delivery_tag in state.prerecorded:  # taken and recorded by a fetch (FETCH)
                state.prerecorded.discard(delivery_tag)
                return virtual.QoS.append(self, message, delivery_tag)
            try:
                if _record_and_take(state, self, message, delivery_tag):
                    return virtual.QoS.append(self, message, delivery_tag)
                return append(self, message, delivery_tag)
            except redis.RedisError as exc:
                if not is_transient(exc):
                    raise
                state.unrecorded[delivery_tag] = unacked_entry(message)
                virtual.QoS.append(self, message, delivery_tag)  # kombu's in-memory books
                logger.warning("Redis refused to record message %s as unacknowledged (%s); "
                               "this worker keeps it until Redis takes writes again",
                               delivery_tag, exc)

        return append_or_keep

    return build


def _record_and_take(state: BrokerState, qos: Any, message: Any, delivery_tag: str) -> bool:
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
        script = client.__dict__.get(_SCRIPT_ATTR)
        if script is None:
            script = client.__dict__[_SCRIPT_ATTR] = client.register_script(FETCH)
        out = script(keys=[qos.unacked_key, qos.unacked_index_key, *keys],
                     args=[time.time(), delivery_tag, unacked_entry(message), want])
    for key, item in zip(out[::2], out[1::2]):
        payload = json.loads(bytes_to_str(item))  # as kombu's own BRPOP read parses it
        state.prerecorded.add(payload["properties"]["delivery_tag"])
        channel._iq_fetched.append((bytes_to_str(key), payload))
    return True


def patches(state: BrokerState) -> list[Patch]:
    return [Patch(kombu_redis.Channel, "_brpop_read", _take_what_waits_with_each_read),
            Patch(kombu_redis.QoS, "append", _record_or_keep(state))]
