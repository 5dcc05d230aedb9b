-- An owner's books of the requests Redis keeps for it: its quota's (kept_bytes_per_key, checked
-- by job_submit.lua). A fragment of _job_prelude.lua, which defines `now` before it.
-- Constants: KEPT_BY_PREFIX, KEPT_BY_BYTES_PREFIX (tasks/keys.py).

-- An owner's quota books (tasks/keys.py's KEPT_BY_PREFIX): the requests whose time is up leave
-- them, the oldest `most` at most; one job's request leaves them when its record drops it or
-- its kept key is deleted. The total moves only with a member that ZADD added or ZREM removed,
-- so that it cannot drift from them; both expire together, no later than their last member.
local function trim_owner_kept(owner, most)
  local books, total = KEPT_BY_PREFIX .. owner, KEPT_BY_BYTES_PREFIX .. owner
  local gone = redis.call('zrangebyscore', books, '-inf', now, 'LIMIT', 0, most)
  if #gone == 0 then return end
  local bytes = 0
  for _, member in ipairs(gone) do bytes = bytes + tonumber(string.match(member, ':(%d+)$')) end
  redis.call('zrem', books, unpack(gone))
  redis.call('decrby', total, bytes)
end
local function release_owner_kept(owner, id, size)
  if redis.call('zrem', KEPT_BY_PREFIX .. owner, id .. ':' .. size) == 1 then
    redis.call('decrby', KEPT_BY_BYTES_PREFIX .. owner, size)
  end
end
-- A job's request, kept until `at` now (for a retry): its member's time moves there (XX: a job
-- submitted before the books has none), and the books live at least as long.
local function rescore_owner_kept(owner, id, size, at)
  local books, total = KEPT_BY_PREFIX .. owner, KEPT_BY_BYTES_PREFIX .. owner
  if redis.call('zadd', books, 'XX', 'CH', at, id .. ':' .. size) == 0 then return end
  local ms = math.ceil((at - now) * 1000)
  if redis.call('pttl', books) < ms then
    redis.call('pexpire', books, ms)
    redis.call('pexpire', total, ms)
  end
end
