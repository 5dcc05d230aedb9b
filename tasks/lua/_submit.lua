-- A job's admission, record and enqueue (job_submit.lua, and each job of
-- job_submit_many.lua): `submit(KEYS, ARGV)`, its keys and arguments as job_submit.lua takes
-- them, the two of every job script first; returns {kind, found}. Runs after the prelude and
-- _owned.

-- Redis's memory as the headroom check sees it: read once a script call (INFO is the dearest
-- command a submit runs: a page of text made and searched), then what each job this call
-- created wrote added to it (its arguments' bytes and a record's overhead), so that the jobs
-- of one call are checked as one reading a job would check them, never below it.
local memory_used, memory_cap
local function memory()
  if not memory_used then
    local info = redis.call('info', 'memory')
    memory_cap = tonumber(string.match(info, 'maxmemory:(%d+)'))
    memory_used = tonumber(string.match(info, 'used_memory:(%d+)'))
  end
  return memory_used, memory_cap
end
local function wrote(ARGV)
  if not memory_used then return end
  local bytes = 512
  for i = 3, #ARGV do bytes = bytes + #ARGV[i] end
  memory_used = memory_used + 2 * bytes  -- the message is in the record and on its list
end

local function submit(KEYS, ARGV)

  -- A write that changes nothing (a key's expiry set to what it is), so that a WAIT after the
  -- script covers that key, which an earlier script wrote: WAIT counts from the last write of
  -- its own connection.
  local function touch(key)
    local ms = redis.call('pttl', key)
    if ms > 0 then redis.call('pexpire', key, ms) end
  end

  if ARGV[8] ~= '' then
    local used, cap = memory()
    if cap > 0 and used > (1 - tonumber(ARGV[8])) * cap then
      if redis.call('exists', KEYS[1]) == 1 then touch(KEYS[1]); return {'created', ARGV[3]} end
      return {'full', used .. ' ' .. cap}
    end
  end
  if redis.call('hsetnx', KEYS[1], 'status', 'queued') == 0 then
    touch(KEYS[1])
    return {'created', ARGV[3]}
  end
  local function refuse(kind, found)
    redis.call('del', KEYS[1])
    return {kind, found}
  end
  if ARGV[6] ~= '' then
    local earlier = redis.call('get', KEYS[2])
    if earlier then
      local sep = string.find(earlier, ' ', 1, true)
      local earlier_id = string.sub(earlier, 1, sep - 1)
      -- A claim whose job was deleted claims nothing: the key makes a new job.
      if redis.call('exists', JOB_PREFIX .. earlier_id) == 1 then
        if string.sub(earlier, sep + 1) ~= ARGV[6] then return refuse('mismatch', '') end
        touch(KEYS[2])
        return refuse('existing', earlier_id)
      end
    end
  end
  if ARGV[11] == '1' then
    local f = redis.call('hmget', KEYS[5], 'status', 'retried_as')
    if not f[1] then return refuse('gone', '') end
    if f[2] then return refuse('retried', f[2]) end
    if f[1] ~= 'failed' and f[1] ~= 'cancelled' and f[1] ~= 'expired' then
      return refuse('not_retryable', f[1])
    end
  end
  if ARGV[4] ~= '' then
    local depth = 0
    for i = 9, #KEYS do depth = depth + redis.call('llen', KEYS[i]) end
    if depth >= tonumber(ARGV[4]) then return refuse('overloaded', '') end
  end
  local kept_size = string.len(ARGV[9])
  if kept_size == 0 then kept_size = tonumber(ARGV[14]) or 0 end
  local books = KEPT_BY_PREFIX .. ARGV[13]
  local total = KEPT_BY_BYTES_PREFIX .. ARGV[13]
  if ARGV[12] ~= '' and kept_size > 0 then
    trim_owner_kept(ARGV[13], 1000)
    local held = tonumber(redis.call('get', total) or 0)
    if held + kept_size > tonumber(ARGV[12]) then
      local first = redis.call('zrange', books, 0, 0, 'WITHSCORES')
      local wait = first[2] and math.max(0, tonumber(first[2]) - now) or 0
      return refuse('kept_full', held .. ' ' .. string.format('%.0f', math.ceil(wait)))
    end
  end
  local fields = {'message', ARGV[7], 'list', KEYS[3]}
  for i = 15, #ARGV do fields[#fields + 1] = ARGV[i] end
  local timeout = tonumber(ARGV[5])
  if timeout > 0 then
    fields[#fields + 1] = 'expires_at'
    fields[#fields + 1] = string.format('%.3f', now + timeout)
  end
  if ARGV[9] ~= '' then
    fields[#fields + 1] = 'request'  -- its request, kept in the record until it ends
    fields[#fields + 1] = ARGV[9]
  elseif ARGV[12] ~= '' and kept_size > 0 then
    fields[#fields + 1] = 'charged'  -- what its owner's books hold for it while it waits
    fields[#fields + 1] = kept_size
  end
  redis.call('hset', KEYS[1], unpack(fields))
  redis.call('expire', KEYS[1], TTL_S)
  if ARGV[6] ~= '' then redis.call('set', KEYS[2], ARGV[3] .. ' ' .. ARGV[6], 'EX', TTL_S) end
  if ARGV[12] ~= '' and kept_size > 0 then
    redis.call('zadd', books, now + TTL_S, ARGV[3] .. ':' .. kept_size)
    redis.call('incrby', total, kept_size)
    if redis.call('pttl', books) < TTL_S * 1000 then
      redis.call('expire', books, TTL_S)
      redis.call('expire', total, TTL_S)
    end
  end
  -- The list stays in time order, newest first, whatever Redis's clock does (a step back, a
  -- failover to a host a little behind): an entry is stamped after the head's, so that a page's
  -- bisection to its cursor (first_at_or_below) never passes over an entry it has not listed.
  local head, us = redis.call('lindex', KEYS[4], 0), now_us
  if head then us = math.max(us, owned_at(head) + 1) end
  redis.call('lpush', KEYS[4], owned_entry(us, ARGV[3]))
  if ARGV[10] ~= '0' then trim_owned(KEYS[4], 1000) end
  if ARGV[10] == '2' then trim(KEYS[8], now_us - TTL_S * 1000000, 1000) end
  if ARGV[11] == '1' then redis.call('hset', KEYS[5], 'retried_as', ARGV[3]) end
  local was_empty = redis.call('lpush', KEYS[3], ARGV[7]) == 1
  redis.call('zadd', KEYS[6], now, ARGV[3])
  if was_empty and redis.call('llen', KEYS[7]) == 0 then redis.call('lpush', KEYS[7], '1') end
  wrote(ARGV)
  return {'created', ARGV[3]}
end
