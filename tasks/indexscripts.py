"""The Lua scripts over what a job leaves beside its record (tasks/jobstate.py runs them): a
page of an owner's index or dead-letter index (LIST), a finished job deleted with its index
entries and kept request (DELETE), and the books of the requests kept for a retry (KEPT).

They take the two common arguments of every job script (tasks/jobscripts.py) and run after its
prelude (its `trim`, `trim_kept`, `expire_if_due` and FIELDS); their own arguments follow from
ARGV[3]."""
from __future__ import annotations

from tasks.jobscripts import PRELUDE
from tasks.keys import JOB_PREFIX, KEPT_BYTES_KEY, KEPT_KEY, dead_index, owner_index

# An entry of an owner's jobs list (tasks/keys.py's owner_jobs), newest first: 7 bytes of its
# submission time (Redis's clock, microseconds, big-endian; the first byte's top bit set when
# the id that follows is text), then the job's id, as the 16 bytes a UUID's canonical text
# stands for (23 bytes an entry), or else as its text. `owned_entry` writes one, `owned_job`
# reads it back (time, id). `trim_owned` drops the entries past the records' time to live (at
# most `most`), `first_at_or_below` finds where a page at a time goes on.
OWNED = """
local UUID = '^' .. string.rep('%x', 8) .. '%-' .. string.rep('%x', 4) .. '%-'
  .. string.rep('%x', 4) .. '%-' .. string.rep('%x', 4) .. '%-' .. string.rep('%x', 12) .. '$'
local function owned_entry(us, id)
  local text = not string.match(id, UUID) or string.find(id, '%u') ~= nil
  local out, n = {}, us
  for i = 7, 1, -1 do out[i] = n % 256; n = math.floor(n / 256) end
  if text then out[1] = out[1] + 128 end
  for i = 1, 7 do out[i] = string.char(out[i]) end
  if text then
    out[8] = id
  else
    local hex = string.gsub(id, '-', '')
    for i = 1, 31, 2 do out[#out + 1] = string.char(tonumber(string.sub(hex, i, i + 1), 16)) end
  end
  return table.concat(out)
end
local function owned_job(entry)
  local first = string.byte(entry, 1)
  local us = first % 128
  for i = 2, 7 do us = us * 256 + string.byte(entry, i) end
  if first >= 128 then return us, string.sub(entry, 8) end
  local h = string.format(string.rep('%02x', 16), string.byte(entry, 8, 23))
  return us, string.sub(h, 1, 8) .. '-' .. string.sub(h, 9, 12) .. '-' .. string.sub(h, 13, 16)
    .. '-' .. string.sub(h, 17, 20) .. '-' .. string.sub(h, 21)
end
local function first_at_or_below(key, us)
  local lo, hi = 0, redis.call('llen', key)
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if owned_job(redis.call('lindex', key, mid)) > us then lo = mid + 1 else hi = mid end
  end
  return lo
end
local function trim_owned(key, most)
  local bound = now_us - TTL_S * 1000000
  local tail = redis.call('lindex', key, -1)
  if not tail or owned_job(tail) >= bound then return end
  local n = redis.call('llen', key)
  local keep = math.max(first_at_or_below(key, bound - 1), n - most)
  if keep == 0 then redis.call('del', key) else redis.call('ltrim', key, 0, keep - 1) end
end
"""

# KEYS: an owner's jobs list and the sorted set releases before this one indexed its jobs in
# (owner_index), or an index alone (the dead-letter one). ARGV: now, expired error, the
# cursor's time and job id ('' : from the newest), page size, scan budget, status ('' : any),
# model ('' : any). Newest first (the two merged by time: an upgrade's API processes of both
# releases write each its own), it reads at most `budget` entries, keeping those that match:
# {next cursor's time and id (false: no more), then per job {id, READ_FIELDS' values, its
# time in the index (what orders it; a merge of several Redis' pages orders by it)}}. An
# entry whose record is gone is skipped (and leaves a sorted set); entries past the records'
# time to live leave both.
LIST = PRELUDE + OWNED + """
local cursor_id, cs = ARGV[6], tonumber(ARGV[5])
local limit, budget, status, model = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9], ARGV[10]
local index = KEYS[#KEYS]
trim(index, now_us - TTL_S * 1000000, 1000)
local zrows = redis.call('zrevrangebyscore', index, ARGV[5] == '' and '+inf' or ARGV[5],
                         '-inf', 'WITHSCORES', 'LIMIT', 0, budget)
local lrows = {}
if #KEYS == 2 then
  trim_owned(KEYS[1], 1000)
  local from = cs and first_at_or_below(KEYS[1], cs) or 0
  for i, entry in ipairs(redis.call('lrange', KEYS[1], from, from + budget - 1)) do
    local us, id = owned_job(entry)
    lrows[i] = {us, id}
  end
  -- Ordered as the sorted set orders its members: among equal times, greater ids first.
  table.sort(lrows, function(a, b) return a[1] > b[1] or (a[1] == b[1] and a[2] > b[2]) end)
end
-- A source that filled its read may hold more: the merge stops where it runs out.
local zfull, lfull = #zrows == 2 * budget, #lrows == budget
local zi, li, lus, lid = 1, 1, nil, nil
local function next_listed()
  if li <= #lrows then lus, lid = lrows[li][1], lrows[li][2] else lus = nil end
  li = li + 1
end
next_listed()
local out, last_us, last_id, read, more = {false, false}, false, false, 0, false
while read < budget and #out - 2 < limit do
  if (zi > #zrows and zfull) or (not lus and lfull) then more = true break end
  local zus, us, id, indexed = zi <= #zrows and tonumber(zrows[zi + 1]), nil, nil, false
  if zus and (not lus or zus > lus or (zus == lus and zrows[zi] > lid)) then
    us, id, indexed, zi = zus, zrows[zi], true, zi + 2
  elseif lus then
    us, id = lus, lid
    next_listed()
  else
    break
  end
  -- Ties with the cursor's time that the previous page saw already are skipped.
  if not cs or us < cs or (us == cs and id < cursor_id) then
    read = read + 1
    local key = '""" + JOB_PREFIX + """' .. id
    local f = redis.call('hmget', key, 'status', 'model', 'expires_at')
    if not f[1] then
      if indexed then redis.call('zrem', index, id) end
    else
      if expire_if_due(key, id, f[1], f[3], ARGV[3], ARGV[4]) then f[1] = 'expired' end
      if (status == '' or f[1] == status) and (model == '' or f[2] == model) then
        out[#out + 1] = {id, redis.call('hmget', key, unpack(FIELDS)), string.format('%.0f', us)}
      end
    end
    last_us, last_id = us, id
  end
end
if last_us and (more or #out - 2 == limit or read == budget) then
  out[1], out[2] = string.format('%.0f', last_us), last_id
end
return out
"""

# KEYS: record, stored result, kept request. ARGV: owner, now, expired error. Deletes a
# finished job of `owner`'s (record, result, kept request, index entries): 'deleted';
# 'missing' (none, or another owner's); or its status when it is not finished.
DELETE = PRELUDE + f"""
local f = redis.call('hmget', KEYS[1], 'status', 'owner', 'kept', 'expires_at')
if not f[1] or (f[2] or '') ~= ARGV[3] then return 'missing' end
local id = id_of(KEYS[1])
if expire_if_due(KEYS[1], id, f[1], f[4], ARGV[4], ARGV[5]) then f[1] = 'expired' end
if f[1] == 'queued' or f[1] == 'running' then return f[1] end
redis.call('del', KEYS[1], KEYS[2], KEYS[3])
redis.call('zrem', '{owner_index("")}' .. ARGV[3], id)
redis.call('zrem', '{dead_index("")}' .. ARGV[3], id)
if f[3] and redis.call('zrem', '{KEPT_KEY}', id .. ':' .. f[3]) == 1 then
  redis.call('decrby', '{KEPT_BYTES_KEY}', f[3])
end
if f[3] then release_owner_kept(ARGV[3], id, f[3]) end
return 'deleted'
"""

# What the kept requests hold now: {jobs, bytes}, after those whose time is up are dropped.
KEPT = PRELUDE + f"""
trim_kept(1000)
return {{redis.call('zcard', '{KEPT_KEY}'), tonumber(redis.call('get', '{KEPT_BYTES_KEY}') or 0)}}
"""
