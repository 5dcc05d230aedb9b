-- A job's admission, record and enqueue (job_submit.lua, and each job of
-- job_submit_many.lua): `submit(K, k, nkeys, A, a, nargs)`, its keys K[k + 1 .. k + nkeys]
-- and its own arguments A[a + 1 .. a + nargs] as job_submit.lua takes them (its KEYS, its
-- ARGV after the two of every job script), read where they are rather than copied into tables
-- of their own (a group's copies cost Redis ~2 µs a job); returns {kind, found}. Runs after
-- the prelude and _owned.

-- Redis's memory as the headroom check sees it: read once a script call (INFO is the dearest
-- command a submit runs: a page of text made and searched), then what each job this call
-- created wrote added to it (its arguments' bytes and a record's overhead), so that the jobs
-- of one call are checked as one reading a job would check them, never below it.
-- (Each field found by plain text, not a pattern: a pattern is tried at every byte of the
-- page, ~4 µs a call.)
local memory_used, memory_cap
local function info_field(info, name)
  local at = string.find(info, '\n' .. name .. ':', 1, true)
  return tonumber(string.match(info, '^%d+', at + #name + 2))
end
local function memory()
  if not memory_used then
    local info = redis.call('info', 'memory')
    memory_cap = info_field(info, 'maxmemory')
    memory_used = info_field(info, 'used_memory')
  end
  return memory_used, memory_cap
end
local function wrote(A, a, nargs)
  if not memory_used then return end
  local bytes = 512
  for i = a + 1, a + nargs do bytes = bytes + #A[i] end
  memory_used = memory_used + 2 * bytes  -- the message is in the record and on its list
end

-- A write that changes nothing (a key's expiry set to what it is), so that a WAIT after the
-- script covers that key, which an earlier script wrote: WAIT counts from the last write of
-- its own connection.
local function touch(key)
  local ms = redis.call('pttl', key)
  if ms > 0 then redis.call('pexpire', key, ms) end
end

-- What every job of a call shares, made once a call: the share of maxmemory kept free as a
-- number (by its text), and Redis's clock as the pending set's score, written as redis.call
-- would write the number (each number passed to it is sprintf'ed, and each tonumber is a
-- strtod).
local headroom_text, headroom_share, now_text
local function submit(K, k, nkeys, A, a, nargs)
  local record, claim, list, owned, retried, pending, wake, index = unpack(K, k + 1, k + 8)
  local id, max_depth, timeout_s, digest, message, headroom, request, trim_what, retry, quota,
        owner, size, packed_id = unpack(A, a + 1, a + 13)

  if headroom ~= '' then
    local used, cap = memory()
    if headroom ~= headroom_text then
      headroom_text, headroom_share = headroom, tonumber(headroom)
    end
    if cap > 0 and used > (1 - headroom_share) * cap then
      if redis.call('exists', record) == 1 then touch(record); return {'created', id} end
      return {'full', used .. ' ' .. cap}
    end
  end
  if redis.call('hsetnx', record, 'status', 'queued') == 0 then
    touch(record)
    return {'created', id}
  end
  local function refuse(kind, found)
    redis.call('del', record)
    return {kind, found}
  end
  if digest ~= '' then
    local earlier = redis.call('get', claim)
    if earlier then
      local sep = string.find(earlier, ' ', 1, true)
      local earlier_id = string.sub(earlier, 1, sep - 1)
      -- A claim whose job was deleted claims nothing: the key makes a new job.
      if redis.call('exists', JOB_PREFIX .. earlier_id) == 1 then
        if string.sub(earlier, sep + 1) ~= digest then return refuse('mismatch', '') end
        touch(claim)
        return refuse('existing', earlier_id)
      end
    end
  end
  if retry == '1' then
    local f = redis.call('hmget', retried, 'status', 'retried_as')
    if not f[1] then return refuse('gone', '') end
    if f[2] then return refuse('retried', f[2]) end
    if f[1] ~= 'failed' and f[1] ~= 'cancelled' and f[1] ~= 'expired' then
      return refuse('not_retryable', f[1])
    end
  end
  if max_depth ~= '' then
    local depth = 0
    for i = k + 9, k + nkeys do depth = depth + redis.call('llen', K[i]) end
    if depth >= tonumber(max_depth) then return refuse('overloaded', '') end
  end
  local kept_size = string.len(request)
  if kept_size == 0 then kept_size = tonumber(size) or 0 end
  local charged = quota ~= '' and kept_size > 0
  local books = charged and KEPT_BY_PREFIX .. owner
  local total = charged and KEPT_BY_BYTES_PREFIX .. owner
  if charged then
    trim_owner_kept(owner, 1000)
    local held = tonumber(redis.call('get', total) or 0)
    if held + kept_size > tonumber(quota) then
      local first = redis.call('zrange', books, 0, 0, 'WITHSCORES')
      local wait = first[2] and math.max(0, tonumber(first[2]) - now) or 0
      return refuse('kept_full', held .. ' ' .. string.format('%.0f', math.ceil(wait)))
    end
  end
  local fields = {'message', message, 'list', list}
  for i = a + 14, a + nargs do fields[#fields + 1] = A[i] end
  local timeout = timeout_s ~= '0' and tonumber(timeout_s) or 0
  if timeout > 0 then
    fields[#fields + 1] = 'expires_at'
    fields[#fields + 1] = string.format('%.3f', now + timeout)
  end
  if request ~= '' then
    fields[#fields + 1] = 'request'  -- its request, kept in the record until it ends
    fields[#fields + 1] = request
  elseif charged then
    fields[#fields + 1] = 'charged'  -- what its owner's books hold for it while it waits
    fields[#fields + 1] = kept_size
  end
  redis.call('hset', record, unpack(fields))
  redis.call('expire', record, TTL_TEXT)
  if digest ~= '' then redis.call('set', claim, id .. ' ' .. digest, 'EX', TTL_TEXT) end
  if charged then
    redis.call('zadd', books, now + TTL_S, id .. ':' .. kept_size)
    redis.call('incrby', total, kept_size)
    if redis.call('pttl', books) < TTL_S * 1000 then
      redis.call('expire', books, TTL_S)
      redis.call('expire', total, TTL_S)
    end
  end
  -- The list stays in time order, newest first, whatever Redis's clock does (a step back, a
  -- failover to a host a little behind): an entry is stamped after the head's, so that a page's
  -- bisection to its cursor (first_at_or_below) never passes over an entry it has not listed.
  local head, us = redis.call('lindex', owned, 0), now_us
  if head then us = math.max(us, owned_at(head) + 1) end
  redis.call('lpush', owned, owned_entry(us, id, packed_id))
  if trim_what ~= '0' then trim_owned(owned, 1000) end
  if trim_what == '2' then trim(index, now_us - TTL_S * 1000000, 1000) end
  if retry == '1' then redis.call('hset', retried, 'retried_as', id) end
  local was_empty = redis.call('lpush', list, message) == 1
  now_text = now_text or string.format('%.17g', now)
  redis.call('zadd', pending, now_text, id)
  if was_empty and redis.call('llen', wake) == 0 then redis.call('lpush', wake, '1') end
  wrote(A, a, nargs)
  return {'created', id}
end
