-- Only a queued job is cancelled (tasks/jobstate.py `cancel`).
-- KEYS: record. ARGV (after the two of every job script): now, cancelled error, expired error.
-- Returns a CancelOutcome: 'cancelled', 'missing', or 'too_late' (running or terminal: its
-- status says which).
-- #include _job_prelude
local f = redis.call('hmget', KEYS[1], 'status', 'expires_at')
local status = f[1]
if not status then return 'missing' end
if expire_if_due(KEYS[1], id_of(KEYS[1]), status, f[2], ARGV[3], ARGV[5])
    or status ~= 'queued' then
  return 'too_late'
end
redis.call('hset', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[3], 'error', ARGV[4])
redis.call('hdel', KEYS[1], 'message', 'list')
dead(KEYS[1], id_of(KEYS[1]))
redis.call('publish', MOVES_CHANNEL, 'done ' .. id_of(KEYS[1]))
return 'cancelled'
