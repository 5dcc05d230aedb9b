-- A reload's turn taken on every queue a worker consumes, or on none (workers/batching/turns.py).
-- KEYS: the turn keys of the worker's queues. ARGV: the worker, the TTL (ms). '' when each key
-- is free or the worker's own (then each is (re)set to it with the TTL), else the holder of
-- the first that is not.
for _, key in ipairs(KEYS) do
  local holder = redis.call('get', key)
  if holder and holder ~= ARGV[1] then return holder end
end
for _, key in ipairs(KEYS) do redis.call('set', key, ARGV[1], 'PX', ARGV[2]) end
return ''
