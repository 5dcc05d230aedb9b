-- A message off the in-flight hash onto its queue's delayed set, due a delay later by Redis's
-- clock: a retry no recovery can copy, since it is at every instant in exactly one place.
-- KEYS: in-flight hash, delayed set. ARGV: the tag it is held under, the delay (s), the
-- message to deliver then ("<list>\n<message>"). Returns 0 (and schedules nothing) when the
-- hash no longer holds the tag: another worker took it back, and its delivery is that one's.
redis.replicate_commands()
if redis.call('hdel', KEYS[1], ARGV[1]) == 0 then return 0 end
local t = redis.call('time')
redis.call('zadd', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[2]),
           ARGV[3])
return 1
