-- A page of an owner's index or dead-letter index (tasks/jobstate.py `page`).
-- KEYS: an owner's jobs list and the sorted set releases before this one indexed its jobs in
-- (owner_index), or an index alone (the dead-letter one). ARGV (after the two of every job
-- script): now, expired error, the cursor's time and job id ('' : from the newest), page
-- size, scan budget, status ('' : any), model ('' : any). Newest first (the two merged by
-- time: an upgrade's API processes of both releases write each its own), it reads at most
-- `budget` entries (fetching `budget` of each source, and again those at the cursor's time
-- that the page before listed, to skip them: its own entry, and in the sorted set the ties,
-- which the list never has), keeping those that match: {next cursor's time and id (false: no more),
-- then per job {id, FIELDS' values, its time in the index (what orders it; a merge of several
-- Redis' pages orders by it)}}. An entry whose record is gone is skipped (and leaves a sorted
-- set); entries past the records' time to live leave both.
-- #include _job_prelude
-- #include _owned
local cursor_id, cs = ARGV[6], tonumber(ARGV[5])
local limit, budget, status, model = tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9], ARGV[10]
local index, fetch = KEYS[#KEYS], budget + (cs and 1 or 0)
trim(index, now_us - TTL_S * 1000000, 1000)
local zfetch = budget + (cs and redis.call('zcount', index, ARGV[5], ARGV[5]) or 0)
local zrows = redis.call('zrevrangebyscore', index, ARGV[5] == '' and '+inf' or ARGV[5],
                         '-inf', 'WITHSCORES', 'LIMIT', 0, zfetch)
local lrows = {}
if #KEYS == 2 then
  trim_owned(KEYS[1], 1000)
  local from = cs and first_at_or_below(KEYS[1], cs) or 0
  for i, entry in ipairs(redis.call('lrange', KEYS[1], from, from + fetch - 1)) do
    local us, id = owned_job(entry)
    lrows[i] = {us, id}
  end
  -- Ordered as the sorted set orders its members: among equal times, greater ids first.
  table.sort(lrows, function(a, b) return a[1] > b[1] or (a[1] == b[1] and a[2] > b[2]) end)
end
-- A source that filled its read may hold more: the merge stops where it runs out.
local zfull, lfull = #zrows == 2 * zfetch, #lrows == fetch
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
    local key = JOB_PREFIX .. id
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
