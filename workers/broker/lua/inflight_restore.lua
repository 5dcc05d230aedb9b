-- Back to the head of its list, each of these tags the in-flight hash still holds (a tag
-- acknowledged or put back meanwhile, or taken by a recovery, is left alone). KEYS: in-flight
-- hash. ARGV: tags, the first to be served first. Returns how many went back.
-- #include _inflight
local n = 0
for i = #ARGV, 1, -1 do
  local entry = redis.call('hget', KEYS[1], ARGV[i])
  if entry then
    redis.call('hdel', KEYS[1], ARGV[i])
    local list, message = split(entry)
    back(list, message)
    n = n + 1
  end
end
return n
