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
-- rest of it, and it runs for every job that succeeds. It works on locals, never on a table
-- keyed by name: a table filled and walked again cost more than the commands.)
-- `succeeded(finished_at, finished_ms, version, error, hook_id, <the fields SUCCEEDED_READ
-- names, from 'token' to 'crashes'>)`, each false when absent (finished_ms: finished_at as a
-- number): the succeeded record's HSET arguments (field, value, ...), which are the whole
-- record (HGETALL's answer), and what its reply channel is sent (_finish.lua).
local function succeeded(finished_at, finished_ms, version, error, hook_id, token,
                         model, created, trace, inputs, priority, owner, format, hook_url,
                         hook_events, started, worker, batch, runs, items_done, retry_of,
                         crashes)
  local r, finished = false, finished_at
  -- Both times numbers (no space inside) and the three joined digits, then the batch's three
  -- words: as each alone would be matched.
  local cn, sn = tonumber(created), tonumber(started)
  if cn and sn and batch and string.find(created .. ' ' .. started .. ' ' .. batch,
                                         '^%d+ %d+ %w+ %d+ %d+$') then
    -- Whole milliseconds (both times digits only, and finished_ms whole) are written by %d,
    -- an integer's path: %.0f takes glibc's floating-point one, the dearest call of the move.
    -- (The words joined after it: string.format makes each of its %s a sprintf call.)
    local form = finished_ms % 1 == 0 and '%d %d ' or '%.0f %.0f '
    r = string.format(form, sn - cn, finished_ms - sn) .. (runs or '0') .. ' '
      .. (inputs or '0') .. ' ' .. batch
    if #r > 64 then
      r = false
    else
      started, finished, runs, inputs, batch = false, false, false, false, false
    end
  end
  local t, w, v = false, false, false
  if trace and #trace <= 64 then t, trace = trace, false end
  if worker and #worker <= 64 then w, worker = worker, false end
  if version and #version <= 64 then v, version = version, false end
  -- Each field present, in this order (a call a field cost more than the field).
  local out, n = {'status', 'succeeded'}, 2
  if token then out[n + 1], out[n + 2], n = 'token', token, n + 2 end
  if model then out[n + 1], out[n + 2], n = 'model', model, n + 2 end
  if created then out[n + 1], out[n + 2], n = 'created_at', created, n + 2 end
  if r then out[n + 1], out[n + 2], n = 'r', r, n + 2 end
  if t then out[n + 1], out[n + 2], n = 't', t, n + 2 end
  if w then out[n + 1], out[n + 2], n = 'w', w, n + 2 end
  if v then out[n + 1], out[n + 2], n = 'v', v, n + 2 end
  if trace then out[n + 1], out[n + 2], n = 'trace_id', trace, n + 2 end
  if worker then out[n + 1], out[n + 2], n = 'worker', worker, n + 2 end
  if version then out[n + 1], out[n + 2], n = 'model_version', version, n + 2 end
  if started then out[n + 1], out[n + 2], n = 'started_at', started, n + 2 end
  if finished then out[n + 1], out[n + 2], n = 'finished_at', finished, n + 2 end
  if runs then out[n + 1], out[n + 2], n = 'runs', runs, n + 2 end
  if inputs then out[n + 1], out[n + 2], n = 'inputs', inputs, n + 2 end
  if batch then out[n + 1], out[n + 2], n = 'batch', batch, n + 2 end
  if priority then out[n + 1], out[n + 2], n = 'priority', priority, n + 2 end
  if owner then out[n + 1], out[n + 2], n = 'owner', owner, n + 2 end
  if format then out[n + 1], out[n + 2], n = 'encoding_format', format, n + 2 end
  if hook_url then out[n + 1], out[n + 2], n = 'webhook_url', hook_url, n + 2 end
  if hook_events then out[n + 1], out[n + 2], n = 'webhook_events', hook_events, n + 2 end
  if items_done then out[n + 1], out[n + 2], n = 'items_done', items_done, n + 2 end
  if retry_of then out[n + 1], out[n + 2], n = 'retry_of', retry_of, n + 2 end
  if crashes then out[n + 1], out[n + 2], n = 'crashes', crashes, n + 2 end
  if error then out[n + 1], out[n + 2], n = 'error', error, n + 2 end
  if hook_id then out[n + 1], out[n + 2], n = 'webhook_id', hook_id, n + 2 end
  return out
end
