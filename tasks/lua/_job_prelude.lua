-- What every job script (job_*.lua, delivery_*.lua) runs first. Every job script takes two
-- common arguments first, ARGV[1] and ARGV[2]: how long the request of a job that did not
-- succeed is kept for a retry (seconds; 0: none is kept) and the records' time to live
-- (`job_ttl_s`); its own arguments follow from ARGV[3].
-- Its constants, and those of every job script, are tasks/job_lua.py's CONSTANTS (key
-- prefixes from tasks/keys.py, the record's field names).

-- Redis's own clock, for deadlines and indexes: one clock for every process. (Redis 6 needs
-- redis.replicate_commands to let a script write after reading TIME; a no-op on 7+.)
redis.replicate_commands()
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])  -- exact: indexes' order
local KEEP_S, TTL_S = tonumber(ARGV[1]), tonumber(ARGV[2])
-- A whole number of seconds as a command's argument: its text as given when it is digits
-- only, else written by %d (a number passed to redis.call is written out with sprintf, every
-- call, ~5 µs of Redis a job in all).
local function whole_text(arg)
  return string.find(arg, '^%d+$') and arg or string.format('%d', tonumber(arg))
end
-- The records' time to live, so.
local TTL_TEXT = whole_text(ARGV[2])
local function id_of(key) return string.sub(key, #JOB_PREFIX + 1) end

-- Drop the members of sorted set `key` scored below `bound`, the oldest `most` at most: bounded
-- work, whatever piled up.
local function trim(key, bound, most)
  local n = redis.call('zcount', key, '-inf', string.format('(%.0f', bound))
  if n > 0 then redis.call('zremrangebyrank', key, 0, math.min(n, most) - 1) end
end

-- Kept requests whose time is up leave the books of what is kept (their keys expire alone).
local function trim_kept(most)
  local gone = redis.call('zrangebyscore', KEPT_KEY, '-inf', now, 'LIMIT', 0, most)
  if #gone == 0 then return end
  local bytes = 0
  for _, member in ipairs(gone) do bytes = bytes + tonumber(string.match(member, ':(%d+)$')) end
  redis.call('decrby', KEPT_BYTES_KEY, bytes)
  redis.call('zrem', KEPT_KEY, unpack(gone))
end

-- #include _owner_books

-- A job that ends without succeeding (failed, cancelled, expired) joins its owner's
-- dead-letter index, and the request its record kept while it waited ('request') moves to a
-- key of its own, kept for a retry within KEEP_S. (A job that succeeds drops it: job_finish.)
-- A record the earlier release's submit wrote (still queued after an upgrade, or from one of
-- its API processes while both run) holds instead the request's size in 'req', the request
-- already in that key: it is kept as that release kept it. (The field's new name also keeps
-- that release's workers from reading a request as a size: their FINISH failed midway.)
-- A job whose request was not kept ('charged': the size its owner's books hold for it while it
-- waits, job_submit.lua) leaves the books as it ends.
local function dead(key, id)
  local f = redis.call('hmget', key, 'owner', 'request', 'req', 'charged')
  local index = DEAD_INDEX .. (f[1] or '')
  redis.call('zadd', index, now_us, id)
  trim(index, now_us - TTL_S * 1000000, 100)
  local size
  if f[4] then
    redis.call('hdel', key, 'charged')
    release_owner_kept(f[1] or '', id, f[4])
    return
  elseif f[2] then
    redis.call('hdel', key, 'request')
    size = string.len(f[2])
    if KEEP_S <= 0 then
      release_owner_kept(f[1] or '', id, size)
      return
    end
    redis.call('set', KEPT_REQUEST .. id, f[2], 'EX', KEEP_S)
    rescore_owner_kept(f[1] or '', id, size, now + KEEP_S)
  elseif f[3] then
    redis.call('hdel', key, 'req')
    if KEEP_S <= 0 then
      redis.call('del', KEPT_REQUEST .. id)
      return
    end
    if redis.call('expire', KEPT_REQUEST .. id, KEEP_S) == 0 then return end
    size = tonumber(f[3])
  else
    return
  end
  redis.call('hset', key, 'kept', size)
  redis.call('zadd', KEPT_KEY, now + KEEP_S, id .. ':' .. size)
  redis.call('incrby', KEPT_BYTES_KEY, size)
  trim_kept(100)
end

-- Expire a queued job whose deadline passed: KEY is the record, `id` its job id.
local function expire_if_due(key, id, status, expires_at, finished_at, error)
  if status == 'queued' and expires_at and expires_at ~= '' and now > tonumber(expires_at) then
    redis.call('hset', key, 'status', 'expired', 'finished_at', finished_at, 'error', error)
    redis.call('hdel', key, 'message', 'list')
    dead(key, id)
    redis.call('publish', MOVES_CHANNEL, 'done ' .. id)
    return true
  end
  return false
end
