-- The read of a queued job whose deadline may have passed (tasks/jobstate.py `read` reads any
-- other job with a pipelined HMGET and GET, no script): expired first if it is due, by Redis's
-- clock.
-- KEYS: record, stored result. ARGV (after the two of every job script): now, expired error.
-- Returns {FIELDS' values, the stored result of a job that succeeded, or false}; {} when there
-- is no record.
-- #include _job_prelude
local f = redis.call('hmget', KEYS[1], 'status', 'expires_at')
if not f[1] then return {} end
expire_if_due(KEYS[1], id_of(KEYS[1]), f[1], f[2], ARGV[3], ARGV[4])
local values = redis.call('hmget', KEYS[1], unpack(FIELDS))
local meta = false
if values[1] == 'succeeded' then meta = redis.call('get', KEYS[2]) end
return {values, meta}
