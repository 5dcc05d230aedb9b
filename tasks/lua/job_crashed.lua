-- A lost pool child counted against each job it was running (tasks/jobstate.py `crashed`).
-- KEYS: records. Returns, per job, how many times a pool child was lost while running it, this
-- time included (0: no record).
-- #include _job_prelude
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('exists', key) == 1 then
    out[i] = redis.call('hincrby', key, 'crashes', 1)
  else
    out[i] = 0
  end
end
return out
