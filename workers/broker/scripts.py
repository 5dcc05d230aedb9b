"""The Lua scripts of the worker's fetch, in-flight record and recovery. Each is one atomic step
inside Redis, so that a message is on its queue, on a worker's in-flight record or (a webhook
retry) in its queue's delayed set at every instant, whatever happens to the worker or to the
connection between two steps.

Keys (besides the queue lists, `tasks.keys` and the job records):

    iq:inflight:<incarnation>  hash: delivery tag -> "<queue list>\\n<message>", what one worker
                               process took and has not acknowledged or put back
    iq:alive:<incarnation>     its lease: a key whose expiry (Redis's clock) the worker pushes
                               forward every heartbeat; gone = the worker stopped beating
    iq:fetchers                hash: incarnation -> node name, every worker that may hold
                               messages, for the recovery to look at

Writes a full Redis refuses (`noeviction`) are the ones flagged `denyoom` (SET, HSET, RPUSH,
...) and only as a script's first write: each script here that must work while Redis is full
starts its writes with a removal (LTRIM, HDEL, DEL, ZREM), so that a move goes through whole;
the lease (PEXPIRE) is never refused.
"""
from __future__ import annotations

from tasks.keys import JOB_PREFIX, PREFIX, wake_key
from tasks.names import PRIORITY_SEP
from tasks.queuemoves import FORWARD_LUA

INFLIGHT_PREFIX = f"{PREFIX}inflight:"
ALIVE_PREFIX = f"{PREFIX}alive:"
FETCHERS_KEY = f"{PREFIX}fetchers"
RECONCILE_MUTEX = f"{PREFIX}reconcile:mutex"
# Messages a fetch could not read (not JSON, or no delivery tag): kept aside, not delivered.
MALFORMED_KEY = f"{PREFIX}malformed"


def _lua(text: str) -> str:
    """A Lua string literal of `text`, every byte escaped (the priority separator is made of
    control characters)."""
    return '"' + "".join(f"\\{b}" for b in text.encode()) + '"'


_HELPERS = f"""
local SEP = {_lua(PRIORITY_SEP)}
local WAKE = {_lua(wake_key(""))}
local INFLIGHT = {_lua(INFLIGHT_PREFIX)}
local ALIVE = {_lua(ALIVE_PREFIX)}
{FORWARD_LUA}
-- An in-flight entry: its queue list and its message.
local function split(entry)
  local cut = string.find(entry, '\\n', 1, true)
  return string.sub(entry, 1, cut - 1), string.sub(entry, cut + 1)
end
-- One wake-up token for the workers of the queue `list` belongs to, unless one waits already.
local woken = {{}}
local function wake(list)
  local cut = string.find(list, SEP, 1, true)
  local key = WAKE .. (cut and string.sub(list, 1, cut - 1) or list)
  if not woken[key] then
    woken[key] = true
    if redis.call('llen', key) == 0 then redis.call('lpush', key, '1') end
  end
end
local function tag_of(message)
  local ok, decoded = pcall(cjson.decode, message)
  if not ok or type(decoded) ~= 'table' or type(decoded['properties']) ~= 'table' then
    return nil
  end
  local tag = decoded['properties']['delivery_tag']
  if type(tag) ~= 'string' then return nil end
  return tag
end
-- A message back at the head of its list: of the queue its queue moved to, if a reload moved
-- it (tasks/queuemoves.py), its record pointed there.
local function back(list, message)
  local to = forward(list)
  redis.call('rpush', to, message)
  relist(message, list, to)
  wake(to)
end
-- Put back what an in-flight hash holds (HGETALL's reply), each at the head of its list.
local function put_back(held)
  for j = #held, 2, -2 do
    local list, message = split(held[j])
    back(list, message)
  end
end
"""

# Take what waits, up to a count, onto the worker's in-flight hash, in one step. KEYS: in-flight
# hash, the worker's lease, then the queue lists in the order they are served (priority steps,
# then queues), then the queues' delayed sets (members "<list>\n<message>", scored by when they
# are due). ARGV: most messages to take, how many lists. The due messages of each delayed set
# (by Redis's clock) go onto their lists first.
# Returns {'nolease'} when the worker holds no lease (it must beat first: a message on a record
# no recovery looks at would be lost with the worker), else {'ok', list, message, list,
# message, ...}, oldest first, each already on the in-flight hash.
FETCH = _HELPERS + """
redis.replicate_commands()
if redis.call('exists', KEYS[2]) == 0 then return {'nolease'} end
local want = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
if #KEYS > 2 + n then
  local t = redis.call('time')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  for i = 3 + n, #KEYS do
    local due = redis.call('zrangebyscore', KEYS[i], '-inf', now, 'limit', 0, want)
    if #due > 0 then
      redis.call('zrem', KEYS[i], unpack(due))
      for j = #due, 1, -1 do
        local list, message = split(due[j])
        redis.call('rpush', list, message)
      end
    end
  end
end
local out, fields = {'ok'}, {}
local taken, last = 0, nil
for i = 3, 2 + n do
  if taken >= want then break end
  local items = redis.call('lrange', KEYS[i], -(want - taken), -1)
  if #items > 0 then
    redis.call('ltrim', KEYS[i], 0, -(#items + 1))
    last = KEYS[i]
    for j = #items, 1, -1 do
      local tag = tag_of(items[j])
      if tag then
        fields[#fields + 1] = tag
        fields[#fields + 1] = KEYS[i] .. '\\n' .. items[j]
        out[#out + 1] = KEYS[i]
        out[#out + 1] = items[j]
      else
        redis.call('rpush', '""" + MALFORMED_KEY + """', items[j])
      end
      taken = taken + 1
    end
  end
end
if #fields > 0 then redis.call('hset', KEYS[1], unpack(fields)) end
-- Full: more may wait, for another worker to take.
if last and taken >= want then wake(last) end
return out
"""

# The worker's lease, pushed forward. KEYS: lease, fetchers. ARGV: incarnation, node name,
# lease (ms). Returns 1 when renewed, 0 when it had to be made again (the first beat, or a
# lease that lapsed): the worker is registered for recovery from then on.
BEAT = """
if redis.call('pexpire', KEYS[1], ARGV[3]) == 1 then return 1 end
redis.call('set', KEYS[1], '1', 'px', ARGV[3])
redis.call('hset', KEYS[2], ARGV[1], ARGV[2])
return 0
"""

# Back to the head of its list, each of these tags the in-flight hash still holds (a tag
# acknowledged or put back meanwhile, or taken by a recovery, is left alone). KEYS: in-flight
# hash. ARGV: tags, the first to be served first. Returns how many went back.
RESTORE = _HELPERS + """
local n = 0
for i = #ARGV, 1, -1 do
  local entry = redis.call('hget', KEYS[1], ARGV[i])
  if entry then
    redis.call('hdel', KEYS[1], ARGV[i])
    local list, message = split(entry)
    back(list, message)
    n = n + 1
  end
end
return n
"""

# The in-flight messages of every worker that stopped beating, back on their lists. KEYS:
# fetchers. ARGV: this worker's incarnation, its node name, the lease (ms), how long (ms) an
# earlier incarnation of this node may go without a beat, '1' when a lease that is gone may be
# taken for a dead worker ('0' until this worker has itself held its lease a whole lease
# long: after Redis was away longer than a lease, every lease is gone and the live workers
# must first have had the time to beat). Returns {messages put back, incarnations...}.
REAP = _HELPERS + """
redis.replicate_commands()  -- PTTL is non-deterministic for Redis 6's script replication
local out = {0}
local entries = redis.call('hgetall', KEYS[1])
for i = 1, #entries, 2 do
  local inc, node = entries[i], entries[i + 1]
  if inc ~= ARGV[1] then
    local ttl = redis.call('pttl', ALIVE .. inc)
    local dead = (ttl == -2 and ARGV[5] == '1') or
                 (node == ARGV[2] and ttl < tonumber(ARGV[3]) - tonumber(ARGV[4]))
    if dead then
      local held = redis.call('hgetall', INFLIGHT .. inc)
      redis.call('del', INFLIGHT .. inc, ALIVE .. inc)
      redis.call('hdel', KEYS[1], inc)
      put_back(held)
      out[1] = out[1] + #held / 2
      out[#out + 1] = inc
    end
  end
end
return out
"""

# The second line: a job not final for longer than a lease whose message is nowhere (on no
# queue list, on no worker's in-flight hash) is queued again from its record. At most one
# worker at a time (the mutex); at most ARGV[3] jobs a pass, the longest unchecked first; each
# job checked is looked at again a lease later. KEYS: pending, fetchers, mutex. ARGV: this
# worker's incarnation, the lease (s), jobs a pass, the mutex's life (ms). Returns {jobs
# checked, job ids queued again...}.
RECONCILE = _HELPERS + """
redis.replicate_commands()
local locked = redis.pcall('set', KEYS[3], ARGV[1], 'nx', 'px', ARGV[4])
if type(locked) ~= 'table' or not locked['ok'] then return {0} end
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ids = redis.call('zrangebyscore', KEYS[1], '-inf', now - tonumber(ARGV[2]), 'limit', 0,
                       tonumber(ARGV[3]))
local holders = {}
for _, inc in ipairs(redis.call('hkeys', KEYS[2])) do holders[#holders + 1] = INFLIGHT .. inc end
local out = {#ids}
for _, id in ipairs(ids) do
  local f = redis.call('hmget', '""" + JOB_PREFIX + """' .. id, 'status', 'message', 'list')
  local tag = f[2] and tag_of(f[2])
  if (f[1] ~= 'queued' and f[1] ~= 'running') or not tag or not f[3] then
    redis.call('zrem', KEYS[1], id)
  else
    -- Its queue moved (a reload, tasks/queuemoves.py): looked for on the old list (not moved
    -- yet) and the new, queued again on the new, the record following it there.
    local list = forward(f[3])
    local found = false
    for _, holder in ipairs(holders) do
      if redis.call('hexists', holder, tag) == 1 then found = true break end
    end
    if not found and redis.call('lpos', f[3], f[2], 'rank', -1) then found, list = true, f[3] end
    if not found and list ~= f[3] and redis.call('lpos', list, f[2], 'rank', -1) then
      found = true
    end
    if list ~= f[3] then redis.call('hset', '""" + JOB_PREFIX + """' .. id, 'list', list) end
    if not found then
      redis.call('rpush', list, f[2])
      wake(list)
      out[#out + 1] = id
    end
    redis.call('zadd', KEYS[1], now, id)
  end
end
return out
"""

# A message off the in-flight hash onto its queue's delayed set, due a delay later by Redis's
# clock: a retry no recovery can copy, since it is at every instant in exactly one place.
# KEYS: in-flight hash, delayed set. ARGV: the tag it is held under, the delay (s), the
# message to deliver then ("<list>\n<message>"). Returns 0 (and schedules nothing) when the
# hash no longer holds the tag: another worker took it back, and its delivery is that one's.
LATER = """
redis.replicate_commands()
if redis.call('hdel', KEYS[1], ARGV[1]) == 0 then return 0 end
local t = redis.call('time')
redis.call('zadd', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2]),
           ARGV[3])
return 1
"""
