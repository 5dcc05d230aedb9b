-- How job_finish.lua writes a succeeded job's record, which lives job_ttl_s (a day) and is read
-- as it was written: what a read needs, in as few bytes as keep it exact. The names that
-- readers of the release before read a finished record by (`status`, `model`, `created_at`,
-- `token`, the webhook's, `owner` ...) stay; five that only a read of this release needs are
-- packed into `r`: "<started_at - created_at> <finished_at - started_at> <runs> <inputs>
-- <batch>" (the times in milliseconds, the batch as `batch_text` writes it); `trace_id`,
-- `worker` and `model_version` are kept as `t`, `w` and `v` (tasks/jobstate.py's
-- record_fields reads them back). (Redis keeps a hash of small values as one compact list,
-- every field name in it: ~90 bytes of names a record.) A record whose fields do not fit that
-- (an ISO time or a JSON batch from an earlier release, a value over 64 bytes, which would
-- turn the hash into Redis's large encoding) is written with its names.
-- (Its tests take one pattern call: each call into Lua's string library costs more than the
-- rest of it, and it runs for every job that succeeds.)
local SHORT_NAMES = {trace_id = 't', worker = 'w', model_version = 'v'}
local function compact(v, finished_at)
  -- Both times numbers (no space inside) and the three joined digits, then the batch's three
  -- words: as each alone would be matched.
  local c, s, b = v.created_at, v.started_at, v.batch
  local cn, sn = tonumber(c), tonumber(s)
  if cn and sn and b and string.find(c .. ' ' .. s .. ' ' .. b, '^%d+ %d+ %w+ %d+ %d+$') then
    local r = string.format('%.0f %.0f %s %s %s', sn - cn, tonumber(finished_at) - sn,
                            v.runs or '0', v.inputs or '0', b)
    if #r <= 64 then
      v.r, v.started_at, v.finished_at, v.runs, v.inputs, v.batch = r, nil, nil, nil, nil, nil
    end
  end
  for long, short in pairs(SHORT_NAMES) do
    if v[long] and #v[long] <= 64 then v[short], v[long] = v[long], nil end
  end
end
