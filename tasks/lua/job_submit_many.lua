-- The submits that arrived together in one API process (tasks/group_commit.py), in one step:
-- each job as job_submit.lua takes it, one after another, on one reading of Redis's clock and
-- one of its memory (each job's writes added to it: _submit.lua's `memory`).
-- KEYS: each job's keys, one job after another. ARGV (after the two of every job script): how
-- many keys and how many arguments each job has (its own, after the two of every job script),
-- two bytes a job in one string (a byte is read without strtod, and one argument costs Redis
-- what a job's two did: ~1,000 instructions each), then each job's arguments, one job after
-- another.
-- Returns one string a job, in order: its answer's kind, a space, what it found (job_submit's
-- {kind, found} in one: Redis makes a script's reply value by value, and a table of two
-- strings a job cost ~2k instructions a job more).
-- #include _job_prelude
-- #include _owned
-- #include _submit
-- The jobs admitted are queued together once every job of the call is through (_submit.lua's
-- `enqueue`): should one job's command fail, those before it, whose records are written, are
-- queued all the same before the error is raised, as they were when each job queued its own.
-- Whether any job's record is there already (a resend) is asked once for them all: one EXISTS
-- of every record (a command a job fewer); only when one is, each job asks its own
-- (_submit.lua's `none_before`).
local counts = ARGV[3]
local out, k, a = {}, 0, 3
local done, failure = pcall(function()
  local records = {}
  for j = 1, #counts / 2 do
    records[j] = KEYS[k + 1]
    k = k + string.byte(counts, 2 * j - 1)
  end
  none_before, k = redis.call('exists', unpack(records)) == 0, 0
  for j = 1, #counts / 2 do
    local nkeys, nargs = string.byte(counts, 2 * j - 1, 2 * j)
    local kind, found = submit(KEYS, k, nkeys, ARGV, a, nargs)
    out[j] = kind .. ' ' .. found
    k, a = k + nkeys, a + nargs
  end
end)
enqueue()
if not done then error(failure, 0) end
return out
