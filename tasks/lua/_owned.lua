-- An entry of an owner's jobs list (tasks/keys.py's owner_jobs), newest first: 7 bytes of its
-- submission time (Redis's clock, microseconds, big-endian; the first byte's top bit set when
-- the id that follows is text), then the job's id, as the 16 bytes a UUID's canonical text
-- stands for (23 bytes an entry), or else as its text. `owned_entry` writes one, `owned_job`
-- reads it back (time, id). `trim_owned` drops the entries past the records' time to live (at
-- most `most`), `first_at_or_below` finds where a page at a time goes on. A fragment of
-- job_submit.lua and job_list.lua, after _job_prelude.lua.
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
