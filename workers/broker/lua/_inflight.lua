-- The helpers of the worker's in-flight scripts (workers/broker/lua.py).
-- Constants: SEP (the priority separator), WAKE (the wake-up lists' prefix), INFLIGHT and
-- ALIVE (the in-flight hashes' and leases' prefixes); those of _queue_forward.lua.
-- #include _queue_forward
-- An in-flight entry: its queue list and its message.
local function split(entry)
  local cut = string.find(entry, '\n', 1, true)
  return string.sub(entry, 1, cut - 1), string.sub(entry, cut + 1)
end
-- One wake-up token for the workers of the queue `list` belongs to, unless one waits already.
local woken = {}
local function wake(list)
  local cut = string.find(list, SEP, 1, true)
  local key = WAKE .. (cut and string.sub(list, 1, cut - 1) or list)
  if not woken[key] then
    woken[key] = true
    if redis.call('llen', key) == 0 then redis.call('lpush', key, '1') end
  end
end
local function tag_of(message)
  local ok, decoded = pcall(cjson.decode, message)
  if not ok or type(decoded) ~= 'table' or type(decoded['properties']) ~= 'table' then
    return nil
  end
  local tag = decoded['properties']['delivery_tag']
  if type(tag) ~= 'string' then return nil end
  return tag
end
-- A message back at the head of its list: of the queue its queue moved to, if a reload moved
-- it (tasks/queuemoves.py), its record pointed there.
local function back(list, message)
  local to = forward(list)
  redis.call('rpush', to, message)
  relist(message, list, to)
  wake(to)
end
-- Put back what an in-flight hash holds (HGETALL's reply), each at the head of its list.
local function put_back(held)
  for j = #held, 2, -2 do
    local list, message = split(held[j])
    back(list, message)
  end
end
