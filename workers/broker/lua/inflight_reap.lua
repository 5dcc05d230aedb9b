-- The in-flight messages of every worker that stopped beating, back on their lists. KEYS:
-- fetchers. ARGV: this worker's incarnation, its node name, the lease (ms), how long (ms) an
-- earlier incarnation of this node may go without a beat, '1' when a lease that is gone may be
-- taken for a dead worker ('0' until this worker has itself held its lease a whole lease
-- long: after Redis was away longer than a lease, every lease is gone and the live workers
-- must first have had the time to beat). Returns {messages put back, incarnations...}.
-- #include _inflight
redis.replicate_commands()  -- PTTL is non-deterministic for Redis 6's script replication
local out = {0}
local entries = redis.call('hgetall', KEYS[1])
for i = 1, #entries, 2 do
  local inc, node = entries[i], entries[i + 1]
  if inc ~= ARGV[1] then
    local ttl = redis.call('pttl', ALIVE .. inc)
    local dead = (ttl == -2 and ARGV[5] == '1') or
                 (node == ARGV[2] and ttl < tonumber(ARGV[3]) - tonumber(ARGV[4]))
    if dead then
      local held = redis.call('hgetall', INFLIGHT .. inc)
      redis.call('del', INFLIGHT .. inc, ALIVE .. inc)
      redis.call('hdel', KEYS[1], inc)
      put_back(held)
      out[1] = out[1] + #held / 2
      out[#out + 1] = inc
    end
  end
end
return out
