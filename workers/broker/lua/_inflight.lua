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
-- A message's delivery tag (its properties'). Decoding a whole message was most of a fetch's
-- time in Redis, so the tag is found by its text where that cannot mistake it: in a message that
-- is a JSON object, the one "delivery_tag" it names, followed by a string without escapes
-- (as kombu and the API write it). Any other message is decoded. A message that looked like one
-- and is not JSON after all is put aside by the worker (workers/broker/fetch.py, `tag_in`
-- there finds the same tag).
local TAG_AT = {'"delivery_tag":"', '"delivery_tag": "'}
local function tag_of(message)
  if string.byte(message, 1) == 123 and string.byte(message, -1) == 125 then
    local first = string.find(message, '"delivery_tag"', 1, true)
    for _, text in ipairs(TAG_AT) do
      if first and string.sub(message, first, first + #text - 1) == text then
        local from = first + #text
        local stop = string.find(message, '"', from, true)
        if stop and string.byte(message, first - 1) ~= 92
            and not string.find(message, '"delivery_tag"', stop, true) then
          local tag = string.sub(message, from, stop - 1)
          if not string.find(tag, '\\', 1, true) then return tag end
        end
      end
    end
  end
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
