-- The worker's lease, pushed forward. KEYS: lease, fetchers. ARGV: incarnation, node name,
-- lease (ms). Returns 1 when renewed, 0 when it had to be made again (the first beat, or a
-- lease that lapsed): the worker is registered for recovery from then on.
if redis.call('pexpire', KEYS[1], ARGV[3]) == 1 then return 1 end
redis.call('set', KEYS[1], '1', 'px', ARGV[3])
redis.call('hset', KEYS[2], ARGV[1], ARGV[2])
return 0
