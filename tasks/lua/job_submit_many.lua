-- The submits that arrived together in one API process (tasks/group_commit.py), in one step:
-- each job as job_submit.lua takes it, one after another, on one reading of Redis's clock and
-- one of its memory (each job's writes added to it: _submit.lua's `memory`).
-- KEYS: each job's keys, one job after another. ARGV (after the two of every job script): how
-- many jobs, then per job how many keys and how many arguments it has (its own, after the two
-- of every job script), then each job's arguments, one job after another.
-- Returns one string a job, in order: its answer's kind, a space, what it found (job_submit's
-- {kind, found} in one: Redis makes a script's reply value by value, a table of tables of two
-- strings ~10k instructions a job of a group, one string a job a tenth of it).
-- #include _job_prelude
-- #include _owned
-- #include _submit
local jobs = tonumber(ARGV[3])
local out, k, a = {}, 0, 3 + 2 * jobs
for j = 1, jobs do
  local nkeys, nargs = tonumber(ARGV[2 + 2 * j]), tonumber(ARGV[3 + 2 * j])
  local answer = submit(KEYS, k, nkeys, ARGV, a, nargs)
  out[j] = answer[1] .. ' ' .. answer[2]
  k, a = k + nkeys, a + nargs
end
return out
