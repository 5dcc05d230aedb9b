-- Lua helpers for a script that declares `SEP` (the priority separator) before them
-- (queue_move.lua, and workers/broker/lua.py through tasks/queuemoves.py's FORWARD_LUA):
-- `forward(list)`, the list a message of `list` belongs on now; `relist(message, from, to)`,
-- its job's record pointed at `to` when it named `from`.
-- Constants (tasks/queuemoves.py): MOVES (the moves hash), MAX_HOPS, JOB_PREFIX.
local function forward(list)
  for _ = 1, MAX_HOPS do
    local cut = string.find(list, SEP, 1, true)
    local queue = cut and string.sub(list, 1, cut - 1) or list
    local to = redis.call('hget', MOVES, queue)
    if not to then return list end
    list = to .. (cut and string.sub(list, cut) or '')
  end
  return list
end
local function relist(message, from, to)
  if from == to then return end
  local ok, decoded = pcall(cjson.decode, message)
  if not ok or type(decoded) ~= 'table' or type(decoded['headers']) ~= 'table' then return end
  local id = decoded['headers']['id']
  if type(id) ~= 'string' then return end
  local key = JOB_PREFIX .. id
  if redis.call('hget', key, 'list') == from then redis.call('hset', key, 'list', to) end
end
