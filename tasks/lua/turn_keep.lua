-- A reload's turn renewed or given back (workers/batching/turns.py).
-- KEYS, ARGV as turn_take.lua's; ARGV[2] '0' deletes. Only the keys still the worker's: how
-- many.
local mine = 0
for _, key in ipairs(KEYS) do
  if redis.call('get', key) == ARGV[1] then
    mine = mine + 1
    if ARGV[2] == '0' then redis.call('del', key) else redis.call('pexpire', key, ARGV[2]) end
  end
end
return mine
