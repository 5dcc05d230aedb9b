-- The submits that arrived together in one API process (tasks/group_commit.py), in one step:
-- each job as job_submit.lua takes it, one after another, on one reading of Redis's clock and
-- one of its memory (each job's writes added to it: _submit.lua's `memory`).
-- KEYS: each job's keys, one job after another. ARGV (after the two of every job script): how
-- many jobs, then per job how many keys and how many arguments it has (its own, after the two
-- of every job script), then each job's arguments, one job after another.
-- Returns each job's {kind, found}, in order.
-- #include _job_prelude
-- #include _owned
-- #include _submit
local jobs = tonumber(ARGV[3])
local out, k, a = {}, 0, 3 + 2 * jobs
for j = 1, jobs do
  local nkeys, nargs = tonumber(ARGV[2 + 2 * j]), tonumber(ARGV[3 + 2 * j])
  out[j] = submit(KEYS, k, nkeys, ARGV, a, nargs)
  k, a = k + nkeys, a + nargs
end
return out
