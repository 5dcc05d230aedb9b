-- A finished job deleted with its index entries and kept request (tasks/jobstate.py `delete`).
-- KEYS: record, stored result, kept request. ARGV (after the two of every job script): owner,
-- now, expired error. Deletes a finished job of `owner`'s (record, result, kept request, index
-- entries): 'deleted'; 'missing' (none, or another owner's); or its status when it is not
-- finished.
-- #include _job_prelude
local f = redis.call('hmget', KEYS[1], 'status', 'owner', 'kept', 'expires_at')
if not f[1] or (f[2] or '') ~= ARGV[3] then return 'missing' end
local id = id_of(KEYS[1])
if expire_if_due(KEYS[1], id, f[1], f[4], ARGV[4], ARGV[5]) then f[1] = 'expired' end
if f[1] == 'queued' or f[1] == 'running' then return f[1] end
redis.call('del', KEYS[1], KEYS[2], KEYS[3])
redis.call('zrem', OWNER_INDEX .. ARGV[3], id)
redis.call('zrem', DEAD_INDEX .. ARGV[3], id)
if f[3] and redis.call('zrem', KEPT_KEY, id .. ':' .. f[3]) == 1 then
  redis.call('decrby', KEPT_BYTES_KEY, f[3])
end
if f[3] then release_owner_kept(ARGV[3], id, f[3]) end
return 'deleted'
