"""The Lua scripts that move a job (tasks/jobstate.py runs them): one per move, each decided
once, inside Redis. The record's field names here are the ones `JobRecord` reads and writes.
Beside them, on the same prelude: the submit script (tasks/submitscript.py), the scripts of the
indexes and kept requests (tasks/indexscripts.py) and of webhook delivery
(tasks/deliveryscripts.py).

Every script takes two common arguments first, ARGV[1] and ARGV[2]: how long the request of a
job that did not succeed is kept for a retry (seconds; 0: none is kept) and the records' time
to live (`job_ttl_s`); its own arguments follow from ARGV[3]."""
from __future__ import annotations

from tasks.keptbooks import OWNER_BOOKS
from tasks.keys import (JOB_PREFIX, KEPT_BYTES_KEY, KEPT_KEY, MOVES_CHANNEL, dead_index,
                        kept_request)

# The fields a read returns. (Not a job's request, kept for a retry: inputs can weigh a
# megabyte and only a retry reads them.) The last four are those of a succeeded job's record as
# FINISH writes it (COMPACT below), in place of the fields they pack.
READ_FIELDS = ("status", "model", "created_at", "trace_id", "inputs", "priority", "owner",
               "encoding_format", "webhook_url", "webhook_events", "token", "expires_at",
               "started_at", "finished_at", "worker", "batch", "runs", "error", "items_done",
               "retry_of", "retried_as", "kept", "model_version", "r", "t", "w", "v")
_FIELDS_LUA = "{" + ", ".join(f"'{name}'" for name in READ_FIELDS) + "}"
# The fields of a record not final yet that its finished record keeps when the job succeeds
# (FINISH writes it afresh): the record's but its message, list, deadline and request. Status
# and token first.
KEEP_FIELDS = ("status", "token", *(name for name in READ_FIELDS[:READ_FIELDS.index("r")]
                                    if name not in ("status", "token", "expires_at")),
               "crashes")
_KEEP_LUA = "{" + ", ".join(f"'{name}'" for name in KEEP_FIELDS) + "}"
# How FINISH writes a succeeded job's record, which lives job_ttl_s (a day) and is read as it
# was written: what a read needs, in as few bytes as keep it exact. The names that readers of
# the release before read a finished record by (`status`, `model`, `created_at`, `token`, the
# webhook's, `owner` ...) stay; five that only a read of this release needs are packed into
# `r`: "<started_at - created_at> <finished_at - started_at> <runs> <inputs> <batch>" (the
# times in milliseconds, the batch as `batch_text` writes it); `trace_id`, `worker` and
# `model_version` are kept as `t`, `w` and `v`. (Redis keeps a hash of small values as one
# compact list, every field name in it: ~90 bytes of names a record.) A record whose fields do
# not fit that (an ISO time or a JSON batch from an earlier release, a value over 64 bytes,
# which would turn the hash into Redis's large encoding) is written with its names.
COMPACT = """
local function compact(v, finished_at)
  local c, s = v.created_at, v.started_at
  if c and s and string.match(c, '^%d+$') and string.match(s, '^%d+$') and v.batch
      and string.match(v.batch, '^%w+ %d+ %d+$') then
    local r = string.format('%.0f %.0f %s %s %s', tonumber(s) - tonumber(c),
                            tonumber(finished_at) - tonumber(s), v.runs or '0', v.inputs or '0',
                            v.batch)
    if #r <= 64 then
      v.r, v.started_at, v.finished_at, v.runs, v.inputs, v.batch = r, nil, nil, nil, nil, nil
    end
  end
  for long, short in pairs({trace_id = 't', worker = 'w', model_version = 'v'}) do
    if v[long] and #v[long] <= 64 then v[short], v[long] = v[long], nil end
  end
end
"""

# What every job script runs first (here and in its sibling modules). Redis's own clock, for
# deadlines and indexes: one clock for every process. (Redis 6 needs redis.replicate_commands
# to let a script write after reading TIME; a no-op on 7+.)
PRELUDE = f"""
redis.replicate_commands()
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])  -- exact: indexes' order
local KEEP_S, TTL_S = tonumber(ARGV[1]), tonumber(ARGV[2])
local FIELDS = {_FIELDS_LUA}
local function id_of(key) return string.sub(key, {len(JOB_PREFIX) + 1}) end

-- Drop the members of sorted set `key` scored below `bound`, the oldest `most` at most: bounded
-- work, whatever piled up.
local function trim(key, bound, most)
  local n = redis.call('zcount', key, '-inf', string.format('(%.0f', bound))
  if n > 0 then redis.call('zremrangebyrank', key, 0, math.min(n, most) - 1) end
end

-- Kept requests whose time is up leave the books of what is kept (their keys expire alone).
local function trim_kept(most)
  local gone = redis.call('zrangebyscore', '{KEPT_KEY}', '-inf', now, 'LIMIT', 0, most)
  if #gone == 0 then return end
  local bytes = 0
  for _, member in ipairs(gone) do bytes = bytes + tonumber(string.match(member, ':(%d+)$')) end
  redis.call('decrby', '{KEPT_BYTES_KEY}', bytes)
  redis.call('zrem', '{KEPT_KEY}', unpack(gone))
end

""" + OWNER_BOOKS + f"""
-- A job that ends without succeeding (failed, cancelled, expired) joins its owner's
-- dead-letter index, and the request its record kept while it waited ('request') moves to a
-- key of its own, kept for a retry within KEEP_S. (A job that succeeds drops it: FINISH.)
-- A record the earlier release's submit wrote (still queued after an upgrade, or from one of
-- its API processes while both run) holds instead the request's size in 'req', the request
-- already in that key: it is kept as that release kept it. (The field's new name also keeps
-- that release's workers from reading a request as a size: their FINISH failed midway.)
local function dead(key, id)
  local f = redis.call('hmget', key, 'owner', 'request', 'req')
  local index = '{dead_index("")}' .. (f[1] or '')
  redis.call('zadd', index, now_us, id)
  trim(index, now_us - TTL_S * 1000000, 100)
  local size
  if f[2] then
    redis.call('hdel', key, 'request')
    size = string.len(f[2])
    if KEEP_S <= 0 then
      release_owner_kept(f[1] or '', id, size)
      return
    end
    redis.call('set', '{kept_request("")}' .. id, f[2], 'EX', KEEP_S)
    rescore_owner_kept(f[1] or '', id, size, now + KEEP_S)
  elseif f[3] then
    redis.call('hdel', key, 'req')
    if KEEP_S <= 0 then
      redis.call('del', '{kept_request("")}' .. id)
      return
    end
    if redis.call('expire', '{kept_request("")}' .. id, KEEP_S) == 0 then return end
    size = tonumber(f[3])
  else
    return
  end
  redis.call('hset', key, 'kept', size)
  redis.call('zadd', '{KEPT_KEY}', now + KEEP_S, id .. ':' .. size)
  redis.call('incrby', '{KEPT_BYTES_KEY}', size)
  trim_kept(100)
end

-- Expire a queued job whose deadline passed: KEY is the record, `id` its job id.
local function expire_if_due(key, id, status, expires_at, finished_at, error)
  if status == 'queued' and expires_at and expires_at ~= '' and now > tonumber(expires_at) then
    redis.call('hset', key, 'status', 'expired', 'finished_at', finished_at, 'error', error)
    redis.call('hdel', key, 'message', 'list')
    dead(key, id)
    redis.call('publish', '{MOVES_CHANNEL}', 'done ' .. id)
    return true
  end
  return false
end
"""

# KEYS: the batch's records, then (optional) the in-flight hash of the worker that holds their
# messages. ARGV: started_at, worker, batch, finished_at, expired error, then per job its
# token as its message carries it ('' : none) and its message's delivery tag ('' : no in-flight
# hash). Returns, per job, a StartDecision: 'run', or why it must not run ('missing',
# 'foreign': the message is not the job's own, its token differs from the record's;
# 'cancelled', 'expired', 'finished': it succeeded or failed already, or 'lapsed': its message
# is no longer this worker's, taken back while its lease had lapsed). The jobs that run are
# announced on the moves channel, in one message.
START = PRELUDE + f"""
local out, ran = {{}}, {{}}
local records, held = (#ARGV - 7) / 2, nil
if #KEYS > records then
  local tags = {{}}
  for i = 1, records do tags[i] = ARGV[7 + 2 * i] end
  held = redis.call('hmget', KEYS[#KEYS], unpack(tags))
end
for i = 1, records do
  local key = KEYS[i]
  local f = redis.call('hmget', key, 'status', 'expires_at', 'token', 'runs', 'batch', 'worker')
  local status = f[1]
  if held and not held[i] then
    out[i] = 'lapsed'
  elseif not status then
    out[i] = 'missing'
  elseif f[3] and f[3] ~= ARGV[6 + 2 * i] then
    out[i] = 'foreign'
  elseif expire_if_due(key, id_of(key), status, f[2], ARGV[6], ARGV[7]) then
    out[i] = 'expired'
  elseif status == 'running' and f[5] == ARGV[5] and f[6] == ARGV[4] then
    -- This very start sent again (a worker's retry after a timeout, each try of which a frozen
    -- Redis runs once it resumes): the batch started once, and counts once.
    out[i] = 'run'
  elseif status == 'queued' or status == 'running' then
    redis.call('hset', key, 'status', 'running', 'started_at', ARGV[3], 'worker', ARGV[4],
               'batch', ARGV[5], 'runs', (tonumber(f[4]) or 0) + 1)
    out[i] = 'run'
    ran[#ran + 1] = id_of(key)
  elseif status == 'cancelled' or status == 'expired' then
    out[i] = status
  else
    out[i] = 'finished'
  end
end
if #ran > 0 then redis.call('publish', '{MOVES_CHANNEL}', 'running ' .. table.concat(ran, ' ')) end
return out
"""

# KEYS: the records of jobs running in a batch that spans several model calls. ARGV: per job,
# its items done. Only a running job moves; those that did are announced in one message.
PROGRESS = PRELUDE + f"""
local moved = {{}}
for i, key in ipairs(KEYS) do
  if redis.call('hget', key, 'status') == 'running' then
    redis.call('hset', key, 'items_done', ARGV[i + 2])
    moved[#moved + 1] = id_of(key)
  end
end
if #moved > 0 then
  redis.call('publish', '{MOVES_CHANNEL}', 'progress ' .. table.concat(moved, ' '))
end
return #moved
"""

# KEYS: (record, stored result) per job, then the pending set. ARGV: finished_at, result ttl,
# model version ('' : none), then per job: status, stored result, error ('' : none), webhook
# list ('' : none), webhook message, the webhook queue's wake-up list, the token of the message
# that ran it, the webhook delivery's id (recorded: the one delivery CLAIM_DELIVERY lets
# through). Returns, per job, 1 when it took its terminal status here, 0 when it already had
# one (or the message was not the job's own). The jobs it finished are announced on the moves
# channel, "done <id> <id> ...", in one message (as are a cancel's and an expiry's, one job).
# A finished record keeps what a read needs (and its token, so that a message sent by hand with
# its id is still told apart): not its message, deadline or request. That of a job that
# succeeded is written afresh (DEL, HSET, EXPIRE: it lives job_ttl_s from its finish), COMPACT:
# Redis keeps a hash that once held a large value (the message) in its large encoding for good,
# one written with small values only takes its compact one (a listpack). The batch's succeeded
# records go in one DEL, after every job was decided. One that did not succeed drops the
# fields (its error is seldom small).
_FINISH_BODY = COMPACT + f"""
local out, done, writes, gone = {{}}, {{}}, {{}}, {{}}
local ttl = tonumber(ARGV[4])
local KEEP = {_KEEP_LUA}
-- Read beside them: 'req', the size of the request an earlier release's submit kept in a key
-- of its own (dead() above), for a success to drop that key as that release did.
local READ = {{unpack(KEEP)}}
READ[#READ + 1] = 'req'
for i = 1, (#KEYS - 1) / 2 do
  local key, a = KEYS[2 * i - 1], 5 + 8 * (i - 1)
  local f = redis.call('hmget', key, unpack(READ))
  local status = f[1]
  out[i] = 0
  if (status == 'queued' or status == 'running') and (not f[2] or f[2] == ARGV[a + 7])
      and not writes[key] then
    local v = {{}}
    if ARGV[a + 1] == 'succeeded' then
      for j = 2, #KEEP do if f[j] then v[KEEP[j]] = f[j] end end
      gone[#gone + 1] = key
      local size = redis.call('hstrlen', key, 'request')  -- its request leaves with it
      if size > 0 then release_owner_kept(v.owner or '', id_of(key), size) end
      if f[#READ] then gone[#gone + 1] = '{kept_request("")}' .. id_of(key) end
    end
    -- Its status, and its model version, error and webhook delivery's id if any.
    v.status, v.finished_at = ARGV[a + 1], ARGV[3]
    if ARGV[5] ~= '' then v.model_version = ARGV[5] end
    if ARGV[a + 3] ~= '' then v.error = ARGV[a + 3] end
    if ARGV[a + 4] ~= '' then v.webhook_id = ARGV[a + 8] end
    if ARGV[a + 1] == 'succeeded' then compact(v, ARGV[3]) end
    writes[key], out[i] = v, 1
  end
end
if #gone > 0 then redis.call('del', unpack(gone)) end
for i = 1, (#KEYS - 1) / 2 do
  local key, meta_key, a = KEYS[2 * i - 1], KEYS[2 * i], 5 + 8 * (i - 1)
  if out[i] == 1 then
    local fields = {{'status', writes[key].status}}
    for name, value in pairs(writes[key]) do
      if name ~= 'status' then fields[#fields + 1] = name; fields[#fields + 1] = value end
    end
    redis.call('hset', key, unpack(fields))
    if ARGV[a + 1] == 'succeeded' then
      redis.call('expire', key, TTL_S)
    else
      redis.call('hdel', key, 'message', 'list')
      dead(key, id_of(key))
    end
    redis.call('set', meta_key, ARGV[a + 2], 'EX', ttl)
    if ARGV[a + 4] ~= '' then
      redis.call('lpush', ARGV[a + 4], ARGV[a + 5])
      if redis.call('llen', ARGV[a + 6]) == 0 then redis.call('lpush', ARGV[a + 6], '1') end
    end
    done[#done + 1] = id_of(key)
  end
end
if #done > 0 then
  redis.call('zrem', KEYS[#KEYS], unpack(done))
  redis.call('publish', '{MOVES_CHANNEL}', 'done ' .. table.concat(done, ' '))
end
return out
"""
FINISH = PRELUDE + _FINISH_BODY

# FINISH of one job whose message waits on a queue list, with two more ARGV: that list and
# the message. The message is taken off the list (LREM) and the job finished in one step, so
# no worker can fetch it in between; a message no longer there (a worker took it) finishes
# nothing: returns {-1}. For a reload's removed models (scripts/reload_removed.py).
FINISH_QUEUED = PRELUDE + """
if redis.call('lrem', ARGV[#ARGV - 1], 1, ARGV[#ARGV]) == 0 then return {-1} end
""" + _FINISH_BODY

# KEYS: record. ARGV: now, cancelled error, expired error. Returns a CancelOutcome:
# 'cancelled', 'missing', or 'too_late' (running or terminal: its status says which).
CANCEL = PRELUDE + f"""
local f = redis.call('hmget', KEYS[1], 'status', 'expires_at')
local status = f[1]
if not status then return 'missing' end
if expire_if_due(KEYS[1], id_of(KEYS[1]), status, f[2], ARGV[3], ARGV[5])
    or status ~= 'queued' then
  return 'too_late'
end
redis.call('hset', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[3], 'error', ARGV[4])
redis.call('hdel', KEYS[1], 'message', 'list')
dead(KEYS[1], id_of(KEYS[1]))
redis.call('publish', '{MOVES_CHANNEL}', 'done ' .. id_of(KEYS[1]))
return 'cancelled'
"""

# The read of a queued job whose deadline may have passed (JobState.read reads any other job
# with a pipelined HMGET and GET, no script): expired first if it is due, by Redis's clock.
# KEYS: record, stored result. ARGV: now, expired error. Returns {READ_FIELDS' values,
# the stored result of a job that succeeded, or false}; {} when there is no record.
READ = PRELUDE + """
local f = redis.call('hmget', KEYS[1], 'status', 'expires_at')
if not f[1] then return {} end
expire_if_due(KEYS[1], id_of(KEYS[1]), f[1], f[2], ARGV[3], ARGV[4])
local values = redis.call('hmget', KEYS[1], unpack(FIELDS))
local meta = false
if values[1] == 'succeeded' then meta = redis.call('get', KEYS[2]) end
return {values, meta}
"""

# KEYS: records. Returns, per job, how many times a pool child was lost while running it, this
# time included (0: no record).
CRASHED = PRELUDE + """
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('exists', key) == 1 then
    out[i] = redis.call('hincrby', key, 'crashes', 1)
  else
    out[i] = 0
  end
end
return out
"""
