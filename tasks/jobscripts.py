"""The Lua scripts that move a job (tasks/jobstate.py runs them): one per move, each decided
once, inside Redis. The record's field names here are the ones `JobRecord` reads and writes."""
from __future__ import annotations

from tasks.keys import DONE_PREFIX, JOB_PREFIX

# Redis's own clock, for deadlines: one clock for every process that decides expiry, read
# (TIME) only when a deadline is to be judged. (redis.replicate_commands lets a script write
# after reading TIME on Redis 6, if called before its first write; a no-op on 7+.)
_CLOCK = """
local clock = nil
local function now_s()
  if not clock then
    redis.replicate_commands()
    local t = redis.call('time')
    clock = tonumber(t[1]) + tonumber(t[2]) / 1000000
  end
  return clock
end
"""

# Expire a queued job whose deadline passed: KEY is the record, `id` its job id.
_EXPIRE_IF_DUE = """
local function expire_if_due(key, id, status, expires_at, finished_at, error)
  if status == 'queued' and expires_at and expires_at ~= '' and now_s() > tonumber(expires_at)
  then
    redis.call('hset', key, 'status', 'expired', 'finished_at', finished_at, 'error', error)
    redis.call('publish', '""" + DONE_PREFIX + """' .. id, 'expired')
    return true
  end
  return false
end
"""

_ID_OF = f"local function id_of(key) return string.sub(key, {len(JOB_PREFIX) + 1}) end\n"

# KEYS: record, idempotency claim, target list, then the model's queue lists (for its depth).
# ARGV: job id, ttl, max depth, timeout_s (0: none), request digest ('' : no idempotency key),
#       message, memory headroom (share of maxmemory kept free), then the record's field/value
#       pairs.
SUBMIT = _CLOCK + """
local ttl = tonumber(ARGV[2])
local memory = redis.call('info', 'memory')
local cap = tonumber(string.match(memory, 'maxmemory:(%d+)'))
local used = tonumber(string.match(memory, 'used_memory:(%d+)'))
if cap > 0 and used > (1 - tonumber(ARGV[7])) * cap then
  return {'full', used .. ' ' .. cap}
end
if ARGV[5] ~= '' then
  local earlier = redis.call('get', KEYS[2])
  if earlier then
    local sep = string.find(earlier, ' ', 1, true)
    if string.sub(earlier, sep + 1) ~= ARGV[5] then return {'mismatch', ''} end
    return {'existing', string.sub(earlier, 1, sep - 1)}
  end
end
local depth = 0
for i = 4, #KEYS do depth = depth + redis.call('llen', KEYS[i]) end
if depth >= tonumber(ARGV[3]) then return {'overloaded', ''} end
local fields = {}
for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
local timeout = tonumber(ARGV[4])
if timeout > 0 then
  fields[#fields + 1] = 'expires_at'
  fields[#fields + 1] = string.format('%.3f', now_s() + timeout)
end
redis.call('hset', KEYS[1], unpack(fields))
redis.call('expire', KEYS[1], ttl)
if ARGV[5] ~= '' then redis.call('set', KEYS[2], ARGV[1] .. ' ' .. ARGV[5], 'EX', ttl) end
redis.call('lpush', KEYS[3], ARGV[6])
return {'created', ARGV[1]}
"""

# KEYS: the batch's records. ARGV: started_at, worker, batch, finished_at, expired error,
# then each job's token as its message carries it ('' : none).
# Returns, per job, a StartDecision: 'run', or why it must not run ('missing', 'foreign': the
# message is not the job's own, its token differs from the record's; 'cancelled', 'expired', or
# 'finished': it succeeded or failed already).
START = _CLOCK + _EXPIRE_IF_DUE + _ID_OF + """
now_s()  -- before the first write (Redis 6.2)
local out = {}
for i, key in ipairs(KEYS) do
  local f = redis.call('hmget', key, 'status', 'expires_at', 'token', 'runs')
  local status = f[1]
  if not status then
    out[i] = 'missing'
  elseif f[3] and f[3] ~= ARGV[5 + i] then
    out[i] = 'foreign'
  elseif expire_if_due(key, id_of(key), status, f[2], ARGV[4], ARGV[5]) then
    out[i] = 'expired'
  elseif status == 'queued' or status == 'running' then
    redis.call('hset', key, 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2],
               'batch', ARGV[3], 'runs', (tonumber(f[4]) or 0) + 1)
    out[i] = 'run'
  elseif status == 'cancelled' or status == 'expired' then
    out[i] = status
  else
    out[i] = 'finished'
  end
end
return out
"""

# KEYS: (record, stored result) per job. ARGV: finished_at, result ttl, then per job: status,
# stored result, error ('' : none), webhook list ('' : none), webhook message, the token of the
# message that ran it. Returns, per job, 1 when it took its terminal status here, 0 when it
# already had one (or the message was not the job's own).
FINISH = _ID_OF + """
local out = {}
local ttl = tonumber(ARGV[2])
for i = 1, #KEYS / 2 do
  local key, meta_key, a = KEYS[2 * i - 1], KEYS[2 * i], 2 + 6 * (i - 1)
  local f = redis.call('hmget', key, 'status', 'token')
  local status = f[1]
  if (status == 'queued' or status == 'running') and (not f[2] or f[2] == ARGV[a + 6]) then
    redis.call('hset', key, 'status', ARGV[a + 1], 'finished_at', ARGV[1])
    redis.call('hdel', key, 'token', 'expires_at', 'inputs')  -- what no read needs
    if ARGV[a + 3] ~= '' then redis.call('hset', key, 'error', ARGV[a + 3]) end
    redis.call('set', meta_key, ARGV[a + 2], 'EX', ttl)
    if ARGV[a + 4] ~= '' then redis.call('lpush', ARGV[a + 4], ARGV[a + 5]) end
    redis.call('publish', '""" + DONE_PREFIX + """' .. id_of(key), ARGV[a + 1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# KEYS: record. ARGV: the event, the delivery's id. Returns a DeliveryClaim: 'deliver' (this
# delivery owns the job's one webhook: the event is its terminal status and one it asked for),
# or why not: 'missing' (no record, or no webhook), 'not_its_status', 'not_asked',
# 'duplicate' (another delivery took it).
CLAIM_DELIVERY = """
local f = redis.call('hmget', KEYS[1], 'status', 'webhook_url', 'webhook_events', 'webhook_id')
if not f[1] or not f[2] then return 'missing' end
if f[1] ~= ARGV[1] then return 'not_its_status' end
if f[3] and not string.find(',' .. f[3] .. ',', ',' .. ARGV[1] .. ',', 1, true) then
  return 'not_asked'
end
if f[4] and f[4] ~= ARGV[2] then return 'duplicate' end
redis.call('hset', KEYS[1], 'webhook_id', ARGV[2])
return 'deliver'
"""

# KEYS: record. ARGV: now, cancelled error, expired error. Returns a CancelOutcome:
# 'cancelled', 'missing', or 'too_late' (running or terminal: its status says which).
CANCEL = _CLOCK + _EXPIRE_IF_DUE + _ID_OF + """
local f = redis.call('hmget', KEYS[1], 'status', 'expires_at')
local status = f[1]
if not status then return 'missing' end
if expire_if_due(KEYS[1], id_of(KEYS[1]), status, f[2], ARGV[1], ARGV[3])
    or status ~= 'queued' then
  return 'too_late'
end
redis.call('hset', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[1], 'error', ARGV[2])
redis.call('publish', '""" + DONE_PREFIX + """' .. id_of(KEYS[1]), 'cancelled')
return 'cancelled'
"""

# KEYS: record, stored result. ARGV: now, expired error. Returns {fields, the stored result of
# a job that succeeded, or false}: a finished job's read is one HGETALL and one GET.
READ = _CLOCK + _EXPIRE_IF_DUE + _ID_OF + """
local flat = redis.call('hgetall', KEYS[1])
if #flat == 0 then return {} end
local f = {}
for i = 1, #flat, 2 do f[flat[i]] = flat[i + 1] end
if expire_if_due(KEYS[1], id_of(KEYS[1]), f['status'], f['expires_at'], ARGV[1], ARGV[2]) then
  flat = redis.call('hgetall', KEYS[1])
  f['status'] = 'expired'
end
local meta = false
if f['status'] == 'succeeded' then meta = redis.call('get', KEYS[2]) end
return {flat, meta}
"""
