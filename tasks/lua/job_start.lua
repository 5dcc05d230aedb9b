-- A batch's jobs become running (tasks/jobstate.py `start`).
-- KEYS: the batch's records, then (optional) the in-flight hash of the worker that holds their
-- messages. ARGV (after the two of every job script): started_at, worker, batch, finished_at,
-- expired error, then per job its token as its message carries it ('' : none) and its
-- message's delivery tag ('' : no in-flight hash). Returns, per job, a StartDecision: 'run',
-- or why it must not run ('missing', 'foreign': the message is not the job's own, its token
-- differs from the record's; 'cancelled', 'expired', 'finished': it succeeded or failed
-- already, or 'lapsed': its message is no longer this worker's, taken back while its lease
-- had lapsed). The jobs that run are announced on the moves channel, in one message.
-- #include _job_prelude
local out, ran = {}, {}
local records, held = (#ARGV - 7) / 2, nil
if #KEYS > records then
  local tags = {}
  for i = 1, records do tags[i] = ARGV[7 + 2 * i] end
  held = redis.call('hmget', KEYS[#KEYS], unpack(tags))
end
for i = 1, records do
  local key = KEYS[i]
  -- Its batch and worker only when it is running already (a start sent again, below): a
  -- queued job, nearly every one, has none to compare.
  local f = redis.call('hmget', key, 'status', 'expires_at', 'token', 'runs')
  local status = f[1]
  if held and not held[i] then
    out[i] = 'lapsed'
  elseif not status then
    out[i] = 'missing'
  elseif f[3] and f[3] ~= ARGV[6 + 2 * i] then
    out[i] = 'foreign'
  elseif expire_if_due(key, id_of(key), status, f[2], ARGV[6], ARGV[7]) then
    out[i] = 'expired'
  elseif status == 'running' and redis.call('hget', key, 'batch') == ARGV[5]
      and redis.call('hget', key, 'worker') == ARGV[4] then
    -- This very start sent again (a worker's retry after a timeout, each try of which a frozen
    -- Redis runs once it resumes): the batch started once, and counts once.
    out[i] = 'run'
  elseif status == 'queued' or status == 'running' then
    redis.call('hset', key, 'status', 'running', 'started_at', ARGV[3], 'worker', ARGV[4],
               'batch', ARGV[5], 'runs', f[4] and tostring(tonumber(f[4]) + 1) or '1')
    out[i] = 'run'
    ran[#ran + 1] = id_of(key)
  elseif status == 'cancelled' or status == 'expired' then
    out[i] = status
  else
    out[i] = 'finished'
  end
end
if #ran > 0 then redis.call('publish', MOVES_CHANNEL, 'running ' .. table.concat(ran, ' ')) end
return out
