-- A job's admission, record and enqueue (job_submit.lua, and each job of
-- job_submit_many.lua): `submit(K, k, nkeys, A, a, nargs)`, its keys K[k + 1 .. k + nkeys]
-- and its own arguments A[a + 1 .. a + nargs] as job_submit.lua takes them (its KEYS, its
-- ARGV after the two of every job script), read where they are rather than copied into tables
-- of their own (a group's copies cost Redis ~2 µs a job); returns kind, found (two values: a
-- table a job is one more allocation for Lua's collector). Runs after
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
-- number (by its text), and the pending set's score: Redis's clock in whole seconds, rounded
-- up (a job looks younger than it is by under a second, so the reconciler's "not final for
-- longer than a lease" never comes early). A whole number is what keeps that set's compact
-- form cheap: Redis stores it as an integer there, so finding where a member goes reads each
-- member's score without strtod, and writes the new one without sprintf's "%.17g" (~8k of
-- Redis's instructions a job of 16 submitted together). Written by %d, not by redis.call's
-- "%.17g" of a number.
local headroom_text, headroom_share, now_text
-- A call's enqueues, made once its jobs are all admitted (`enqueue`): the messages of each
-- queue list in the order its jobs came, pushed by one LPUSH, and the ids the pending set
-- gains, added by one ZADD (every member scored by the call's one clock); a job's queue list
-- and its wake-up list beside them. One command of each a call rather than a job: each command
-- a script runs costs Redis its own call, its reply to Lua and its line in the append-only file
-- (~4k instructions). The scripts are atomic: no client sees a record before its message. A
-- job checking its queue's depth counts the messages waiting here too (`queued`).
local lists, messages, wake_of, sets, scored = {}, {}, {}, {}, {}
-- An owner's jobs list (_owned.lua) the same way: its new entries, newest last, pushed by one
-- LPUSH a list a call (`owned_keys`, in the order first met), after which its trims requested
-- run (`trims`: as many as its jobs asked for; a trim keeps every entry this call pushed, all
-- newer than the records' time to live); and the time stamped last on each list (`stamped`,
-- the head's: read by one LINDEX a list a call, false when the list is empty), which the next
-- entry is stamped after. The list is read nowhere else in a call, so it is as a push a job
-- left it.
local owned_keys, entries_of, stamped, trims = {}, {}, {}, {}
-- Whether a call found none of its jobs' records before its first job (job_submit_many.lua's
-- one EXISTS for them all): a job's record is then one this call wrote (`made`) or none.
local none_before, made = false, {}
local function queued(list)
  local waiting = messages[list]
  return waiting and #waiting or 0
end
-- The owner's jobs list entry of a job submitted now (`owned_entry`), in time order whatever
-- Redis's clock does: stamped after the head's.
local function own(owned, id, packed_id, trim_it)
  local last = stamped[owned]
  if last == nil then
    local head = redis.call('lindex', owned, '0')
    last = head and owned_at(head) or false
  end
  local us = last and math.max(now_us, last + 1) or now_us
  stamped[owned] = us
  local entries = entries_of[owned]
  if not entries then
    entries = {}
    entries_of[owned], owned_keys[#owned_keys + 1], trims[owned] = entries, owned, 0
  end
  entries[#entries + 1] = owned_entry(us, id, packed_id)
  if trim_it then trims[owned] = trims[owned] + 1 end
end
local function enqueue()
  for _, owned in ipairs(owned_keys) do
    redis.call('lpush', owned, unpack(entries_of[owned]))
    for _ = 1, trims[owned] do trim_owned(owned, 1000) end
  end
  for _, list in ipairs(lists) do
    local waiting = messages[list]
    local wake = wake_of[list]
    if redis.call('lpush', list, unpack(waiting)) == #waiting and
       redis.call('llen', wake) == 0 then
      redis.call('lpush', wake, '1')
    end
  end
  for _, set in ipairs(sets) do redis.call('zadd', set, unpack(scored[set])) end
end
-- A record's HSET arguments, written afresh by each job (`submit`): one table a call.
local fields = {'status', false, 'message', false, 'list', false, 'model', false,
                'created_at', false, 'trace_id', false, 'inputs', false}
local function submit(K, k, nkeys, A, a, nargs)
  local record, claim, list, owned, retried, pending, wake, index = unpack(K, k + 1, k + 8)
  local id, max_depth, timeout_s, digest, message, headroom, request, quota, owner, size,
        packed_id, model, created_at, trace_id, inputs = unpack(A, a + 1, a + 15)
  -- What the caller need not send (each argument costs Redis ~1,000 instructions): whether it
  -- retries a job (the place of the retried record holds NO_RETRY when it does not), and what
  -- to trim, by its id (ids are random): the owner's jobs list on one submit in 16 (an id
  -- beginning '0'), that and the owner's index of releases before on one in 256 ('00').
  local retry = retried ~= NO_RETRY
  local c1, c2 = string.byte(id, 1, 2)

  -- A record there already: this job was made (a resend). Otherwise nothing is written until
  -- every check has passed, the record by one HSET, its status first as before (one command a
  -- job fewer than a HSETNX that begins the record and a HSET that adds the rest, and Redis
  -- converts no one-field compact hash when the large values come).
  if none_before and made[record] or not none_before and redis.call('exists', record) == 1 then
    touch(record)
    return 'created', id
  end
  if headroom ~= '' then
    local used, cap = memory()
    if headroom ~= headroom_text then
      headroom_text, headroom_share = headroom, tonumber(headroom)
    end
    if cap > 0 and used > (1 - headroom_share) * cap then
      return 'full', used .. ' ' .. cap
    end
  end
  if digest ~= '' then
    local earlier = redis.call('get', claim)
    if earlier then
      local sep = string.find(earlier, ' ', 1, true)
      local earlier_id = string.sub(earlier, 1, sep - 1)
      -- A claim whose job was deleted claims nothing: the key makes a new job.
      if redis.call('exists', JOB_PREFIX .. earlier_id) == 1 then
        if string.sub(earlier, sep + 1) ~= digest then return 'mismatch', '' end
        touch(claim)
        return 'existing', earlier_id
      end
    end
  end
  if retry then
    local f = redis.call('hmget', retried, 'status', 'retried_as')
    if not f[1] then return 'gone', '' end
    if f[2] then return 'retried', f[2] end
    if f[1] ~= 'failed' and f[1] ~= 'cancelled' and f[1] ~= 'expired' then
      return 'not_retryable', f[1]
    end
  end
  if max_depth ~= '' then
    local depth = 0
    for i = k + 9, k + nkeys do depth = depth + redis.call('llen', K[i]) + queued(K[i]) end
    if depth >= tonumber(max_depth) then return 'overloaded', '' end
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
      return 'kept_full', held .. ' ' .. string.format('%.0f', math.ceil(wait))
    end
  end
  -- The fields every record has, in the order the caller's record lists them (submitted_fields:
  -- a record small enough to be kept compact is stored in the order written), named here; the
  -- others as the caller's name/value pairs.
  -- (One table a call, its first n entries this job's: `fields`.)
  fields[2], fields[4], fields[6], fields[8], fields[10], fields[12], fields[14] =
    'queued', message, list, model, created_at, trace_id, inputs
  local n = 14
  for i = a + 16, a + nargs do n = n + 1; fields[n] = A[i] end
  local timeout = timeout_s ~= '0' and tonumber(timeout_s) or 0
  if timeout > 0 then
    fields[n + 1], fields[n + 2], n = 'expires_at', string.format('%.3f', now + timeout), n + 2
  end
  if request ~= '' then
    -- its request, kept in the record until it ends
    fields[n + 1], fields[n + 2], n = 'request', request, n + 2
  elseif charged then
    -- what its owner's books hold for it while it waits
    fields[n + 1], fields[n + 2], n = 'charged', kept_size, n + 2
  end
  redis.call('hset', record, unpack(fields, 1, n))
  made[record] = true
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
  -- Pushed with the call's others (`own`, `enqueue`).
  own(owned, id, packed_id, c1 == 48)
  if c1 == 48 and c2 == 48 then trim(index, now_us - TTL_S * 1000000, 1000) end
  if retry then redis.call('hset', retried, 'retried_as', id) end
  local waiting = messages[list]
  if not waiting then
    waiting = {}
    messages[list], wake_of[list], lists[#lists + 1] = waiting, wake, list
  end
  waiting[#waiting + 1] = message
  now_text = now_text or string.format('%d', t[2] == '0' and t[1] or t[1] + 1)
  local adds = scored[pending]
  if not adds then
    adds = {}
    scored[pending], sets[#sets + 1] = adds, pending
  end
  adds[#adds + 1] = now_text
  adds[#adds + 1] = id
  wrote(A, a, nargs)
  return 'created', id
end
