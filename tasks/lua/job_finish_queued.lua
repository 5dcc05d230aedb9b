-- job_finish.lua of one job whose message waits on a queue list, with two more ARGV: that list
-- and the message. The message is taken off the list (LREM) and the job finished in one step,
-- so no worker can fetch it in between; a message no longer there (a worker took it) finishes
-- nothing: returns {-1}. For a reload's removed models (scripts/reload_removed.py).
-- #include _job_prelude
if redis.call('lrem', ARGV[#ARGV - 1], 1, ARGV[#ARGV]) == 0 then return {-1} end
-- #include _finish
