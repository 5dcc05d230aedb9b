"""The Lua scripts over what a job leaves beside its record (tasks/jobstate.py runs them): a
page of an owner's index or dead-letter index (LIST), a finished job deleted with its index
entries and kept request (DELETE), and the books of the requests kept for a retry (KEPT).

They take the two common arguments of every job script (tasks/jobscripts.py) and run after its
prelude (its `trim`, `trim_kept`, `expire_if_due` and FIELDS); their own arguments follow from
ARGV[3]."""
from __future__ import annotations

from tasks.jobscripts import PRELUDE
from tasks.keys import JOB_PREFIX, KEPT_BYTES_KEY, KEPT_KEY, dead_index, owner_index

# KEYS: an index (an owner's, or its dead-letter one). ARGV: now, expired error, the
# cursor's score and job id ('' : from the newest), page size, scan budget, status ('' : any),
# model ('' : any). Newest first, it reads at most `budget` entries, keeping those that match:
# {next cursor's score and id (false: no more), then per job {id, READ_FIELDS' values}}. An
# entry whose record is gone leaves the index; so do entries past the records' time to live.
LIST = PRELUDE + """
local cursor_score, cursor_id = ARGV[5], ARGV[6]
local limit, budget, status, model = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9], ARGV[10]
trim(KEYS[1], now_us - TTL_S * 1000000, 1000)
local top = cursor_score == '' and '+inf' or cursor_score
local rows = redis.call('zrevrangebyscore', KEYS[1], top, '-inf', 'WITHSCORES', 'LIMIT', 0,
                        budget)
local out, last_score, last_id = {false, false}, false, false
for i = 1, #rows, 2 do
  local id, score = rows[i], rows[i + 1]
  -- Ties with the cursor's score that the previous page saw already are skipped.
  if not (score == cursor_score and id >= cursor_id) then
    local key = '""" + JOB_PREFIX + """' .. id
    local f = redis.call('hmget', key, 'status', 'model', 'expires_at')
    if not f[1] then
      redis.call('zrem', KEYS[1], id)
    else
      if expire_if_due(key, id, f[1], f[3], ARGV[3], ARGV[4]) then f[1] = 'expired' end
      if (status == '' or f[1] == status) and (model == '' or f[2] == model) then
        out[#out + 1] = {id, redis.call('hmget', key, unpack(FIELDS))}
      end
    end
    last_score, last_id = score, id
    if #out - 2 == limit then break end
  end
end
if #out - 2 == limit or #rows == 2 * budget then out[1], out[2] = last_score, last_id end
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
return 'deleted'
"""

# What the kept requests hold now: {jobs, bytes}, after those whose time is up are dropped.
KEPT = PRELUDE + f"""
trim_kept(1000)
return {{redis.call('zcard', '{KEPT_KEY}'), tonumber(redis.call('get', '{KEPT_BYTES_KEY}') or 0)}}
"""
