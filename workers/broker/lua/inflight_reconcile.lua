-- The second line: a job not final for longer than a lease whose message is nowhere (on no
-- queue list, on no worker's in-flight hash) is queued again from its record. At most one
-- worker at a time (the mutex); at most ARGV[3] jobs a pass, the longest unchecked first; each
-- job checked is looked at again a lease later. KEYS: pending, fetchers, mutex. ARGV: this
-- worker's incarnation, the lease (s), jobs a pass, the mutex's life (ms). Returns {jobs
-- checked, job ids queued again...}.
-- #include _inflight
redis.replicate_commands()
local locked = redis.pcall('set', KEYS[3], ARGV[1], 'nx', 'px', ARGV[4])
if type(locked) ~= 'table' or not locked['ok'] then return {0} end
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
-- A job checked is scored as a submit scores it (tasks/lua/_submit.lua): whole seconds, rounded
-- up, so the set keeps its integer scores and the next look is never early.
local now_text = string.format('%d', t[2] == '0' and t[1] or t[1] + 1)
local ids = redis.call('zrangebyscore', KEYS[1], '-inf', now - tonumber(ARGV[2]), 'limit', 0,
                       tonumber(ARGV[3]))
local holders = {}
for _, inc in ipairs(redis.call('hkeys', KEYS[2])) do holders[#holders + 1] = INFLIGHT .. inc end
local out = {#ids}
for _, id in ipairs(ids) do
  local f = redis.call('hmget', JOB_PREFIX .. id, 'status', 'message', 'list')
  local tag = f[2] and tag_of(f[2])
  if (f[1] ~= 'queued' and f[1] ~= 'running') or not tag or not f[3] then
    redis.call('zrem', KEYS[1], id)
  else
    -- Its queue moved (a reload, tasks/queuemoves.py): looked for on the old list (not moved
    -- yet) and the new, queued again on the new, the record following it there.
    local list = forward(f[3])
    local found = false
    for _, holder in ipairs(holders) do
      if redis.call('hexists', holder, tag) == 1 then found = true break end
    end
    if not found and redis.call('lpos', f[3], f[2], 'rank', -1) then found, list = true, f[3] end
    if not found and list ~= f[3] and redis.call('lpos', list, f[2], 'rank', -1) then
      found = true
    end
    if list ~= f[3] then redis.call('hset', JOB_PREFIX .. id, 'list', list) end
    if not found then
      redis.call('rpush', list, f[2])
      wake(list)
      out[#out + 1] = id
    end
    redis.call('zadd', KEYS[1], now_text, id)
  end
end
return out
