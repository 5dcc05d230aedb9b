-- An entry of an owner's jobs list (tasks/keys.py's owner_jobs), newest first: 7 bytes of its
-- submission time (Redis's clock, microseconds, big-endian; the first byte's top bit set when
-- the id that follows is text), then the job's id, as the 16 bytes a UUID's canonical text
-- stands for (23 bytes an entry), or else as its text. `owned_entry` writes one, `owned_job`
-- reads it back (time, id). `trim_owned` drops the entries past the records' time to live (at
-- most `most`), `first_at_or_below` finds where a page at a time goes on. A fragment of
-- job_submit.lua and job_list.lua, after _job_prelude.lua.
-- These run on every submit (an entry written, the head's time read), so they do their work in
-- few calls into Lua's string library: each call costs more than the arithmetic around it.
-- Four bytes of a number below 2^32, most significant first.
local function be32(n)
  local b4 = n % 256; n = (n - b4) / 256
  local b3 = n % 256; n = (n - b3) / 256
  local b2 = n % 256
  return (n - b2) / 256, b2, b3, b4
end
-- `packed`: the 16 bytes the id stands for, packed by the caller (tasks/keys.py's owned_id,
-- once in Python rather than in Lua on every submit), or '' when the id is not a lowercase
-- UUID's canonical text: the id is then kept as its text.
local function owned_entry(us, id, packed)
  local text = packed == ''
  local low = us % 16777216  -- the time's last 3 bytes, then its first 4
  local b1, b2, b3, b4 = be32((us - low) / 16777216)
  local b7 = low % 256; low = (low - b7) / 256
  local b6 = low % 256
  local stamp = string.char(text and b1 + 128 or b1, b2, b3, b4, (low - b6) / 256, b6, b7)
  return stamp .. (text and id or packed)
end
-- An entry's time alone (owned_job's first value), for the head a submit stamps after.
local function owned_at(entry)
  local b1, b2, b3, b4, b5, b6, b7 = string.byte(entry, 1, 7)
  return ((((((b1 % 128) * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6) * 256 + b7
end
local function owned_job(entry)
  local us = owned_at(entry)
  if string.byte(entry, 1) >= 128 then return us, string.sub(entry, 8) end
  local h = string.format(string.rep('%02x', 16), string.byte(entry, 8, 23))
  return us, string.sub(h, 1, 8) .. '-' .. string.sub(h, 9, 12) .. '-' .. string.sub(h, 13, 16)
    .. '-' .. string.sub(h, 17, 20) .. '-' .. string.sub(h, 21)
end
local function first_at_or_below(key, us)
  local lo, hi = 0, redis.call('llen', key)
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if owned_at(redis.call('lindex', key, mid)) > us then lo = mid + 1 else hi = mid end
  end
  return lo
end
local function trim_owned(key, most)
  local bound = now_us - TTL_S * 1000000
  local tail = redis.call('lindex', key, '-1')
  if not tail or owned_at(tail) >= bound then return end
  local n = redis.call('llen', key)
  local keep = math.max(first_at_or_below(key, bound - 1), n - most)
  if keep == 0 then redis.call('del', key) else redis.call('ltrim', key, 0, keep - 1) end
end
