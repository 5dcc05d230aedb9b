-- Redis's clock, `now` in seconds, for the presence scripts (presence_*.lua): never a
-- process's own, which may be skewed. (Redis 6 needs redis.replicate_commands to let a script
-- write after reading TIME; a no-op on 7+.)
redis.replicate_commands()
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
