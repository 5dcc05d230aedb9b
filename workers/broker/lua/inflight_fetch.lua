-- Take what waits, up to a count, onto the worker's in-flight hash, in one step. KEYS: in-flight
-- hash, the worker's lease, then the queue lists in the order they are served (priority steps,
-- then queues), then the queues' delayed sets (members "<list>\n<message>", scored by when
-- they are due). ARGV: most messages to take, how many lists. The due messages of each delayed
-- set (by Redis's clock) go onto their lists first.
-- Returns {'nolease'} when the worker holds no lease (it must beat first: a message on a
-- record no recovery looks at would be lost with the worker), else {'ok', list, message, list,
-- message, ...}, oldest first, each already on the in-flight hash. A message that cannot be
-- read (not JSON, or no delivery tag) goes to MALFORMED, not delivered.
-- #include _inflight
redis.replicate_commands()
if redis.call('exists', KEYS[2]) == 0 then return {'nolease'} end
local want = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
if #KEYS > 2 + n then
  local t = redis.call('time')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  for i = 3 + n, #KEYS do
    local due = redis.call('zrangebyscore', KEYS[i], '-inf', now, 'limit', 0, want)
    if #due > 0 then
      redis.call('zrem', KEYS[i], unpack(due))
      for j = #due, 1, -1 do
        local list, message = split(due[j])
        redis.call('rpush', list, message)
      end
    end
  end
end
local out, fields = {'ok'}, {}
local taken, last = 0, nil
for i = 3, 2 + n do
  if taken >= want then break end
  local items = redis.call('lrange', KEYS[i], -(want - taken), -1)
  if #items > 0 then
    redis.call('ltrim', KEYS[i], 0, -(#items + 1))
    last = KEYS[i]
    for j = #items, 1, -1 do
      local tag = tag_of(items[j])
      if tag then
        fields[#fields + 1] = tag
        fields[#fields + 1] = KEYS[i] .. '\n' .. items[j]
        out[#out + 1] = KEYS[i]
        out[#out + 1] = items[j]
      else
        redis.call('rpush', MALFORMED, items[j])
      end
      taken = taken + 1
    end
  end
end
if #fields > 0 then redis.call('hset', KEYS[1], unpack(fields)) end
-- Full: more may wait, for another worker to take.
if last and taken >= want then wake(last) end
return out
