-- A running job whose inputs span several model calls counts its items done
-- (tasks/jobstate.py `progress`).
-- KEYS: the records of jobs running in a batch that spans several model calls. ARGV (after the
-- two of every job script): per job, its items done. Only a running job moves; those that did
-- are announced in one message.
-- #include _job_prelude
local moved = {}
for i, key in ipairs(KEYS) do
  if redis.call('hget', key, 'status') == 'running' then
    redis.call('hset', key, 'items_done', ARGV[i + 2])
    moved[#moved + 1] = id_of(key)
  end
end
if #moved > 0 then
  redis.call('publish', MOVES_CHANNEL, 'progress ' .. table.concat(moved, ' '))
end
return #moved
