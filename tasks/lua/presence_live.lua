-- Who serves each model now (tasks/presence.py `Presence.live`).
-- KEYS: per model, the consuming set of its queue, its live set and its unhealthy set. ARGV:
-- how recent a heartbeat must be (s). Returns, per model, {consuming workers, live members,
-- unhealthy workers}.
-- #include _clock
local since = now - tonumber(ARGV[1])
local out = {}
for i = 1, #KEYS, 3 do
  out[#out + 1] = redis.call('zrangebyscore', KEYS[i], since, '+inf')
  out[#out + 1] = redis.call('zrangebyscore', KEYS[i + 1], since, '+inf')
  out[#out + 1] = redis.call('zrangebyscore', KEYS[i + 2], now, '+inf')
end
return out
