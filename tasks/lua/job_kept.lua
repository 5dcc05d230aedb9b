-- What the requests kept for retries hold now (tasks/jobstate.py `kept`): {jobs, bytes}, after
-- those whose time is up are dropped. Takes the two arguments of every job script.
-- #include _job_prelude
trim_kept(1000)
return {redis.call('zcard', KEPT_KEY), tonumber(redis.call('get', KEPT_BYTES_KEY) or 0)}
