-- A heartbeat, or an unhealthy mark (tasks/presence.py).
-- KEYS: sorted sets. ARGV: member, how long entries are kept (s), how far ahead of now the
-- member's score goes (s: 0 for a heartbeat, the time it stays for an unhealthy mark).
-- #include _clock
for _, key in ipairs(KEYS) do
  redis.call('zadd', key, now + tonumber(ARGV[3]), ARGV[1])
  redis.call('zremrangebyscore', key, '-inf', now - tonumber(ARGV[2]))
end
return 1
