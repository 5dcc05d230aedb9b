-- What waits on the queues a reload moved goes to their new queues (tasks/queuemoves.py
-- `QueueMoves.move`).
-- KEYS: the moves hash. ARGV: how recent a consuming worker's beat must be (s), most messages
-- to move, then the priority lists' suffixes ('' first). For each move whose old queue no
-- worker consumes, its messages to the new queue's lists (following a chain of moves), oldest
-- served first, each record relisted. Returns {old, new, moved, '1' when a worker still
-- consumes the old queue (nothing moved) else '0', ...}.
-- Constants (tasks/queuemoves.py): SEP, CONSUMING_PREFIX, WAKE_PREFIX and _queue_forward's.
redis.replicate_commands()
-- #include _queue_forward
local t = redis.call('time')
local since = tonumber(t[1]) + tonumber(t[2]) / 1000000 - tonumber(ARGV[1])
local left = tonumber(ARGV[2])
local moves = redis.call('hgetall', KEYS[1])
local out = {}
for i = 1, #moves, 2 do
  local from, to = moves[i], moves[i + 1]
  local moved, held = 0, '0'
  if redis.call('zcount', CONSUMING_PREFIX .. from, since, '+inf') > 0 then
    held = '1'
  else
    for s = 3, #ARGV do
      local src = from .. ARGV[s]
      local dst = forward(src)
      local items = left > 0 and redis.call('lrange', src, 0, left - 1) or {}
      if #items > 0 and dst ~= src then
        redis.call('ltrim', src, #items, -1)
        for _, message in ipairs(items) do
          redis.call('rpush', dst, message)
          relist(message, src, dst)
        end
        local cut = string.find(dst, SEP, 1, true)
        local wake = WAKE_PREFIX .. (cut and string.sub(dst, 1, cut - 1) or dst)
        if redis.call('llen', wake) == 0 then redis.call('lpush', wake, '1') end
        moved = moved + #items
        left = left - #items
      end
    end
  end
  out[#out + 1] = from
  out[#out + 1] = to
  out[#out + 1] = moved
  out[#out + 1] = held
end
return out
