-- An API key's rate limit, a token bucket (app/auth.py `take_token`).
-- KEYS[1] the bucket; ARGV rate/s, burst, now. Returns 0 when a token was taken, else the
-- seconds until one will be there.
local rate, burst, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('hmget', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1]) or burst
local ts = tonumber(state[2]) or now
tokens = math.min(burst, tokens + (now - ts) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('hset', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('expire', KEYS[1], math.ceil(burst / rate) + 60)
return tostring(wait)
