-- What job_finish.lua and job_finish_queued.lua run after the prelude: the jobs' terminal
-- statuses (tasks/jobstate.py `finish`).
-- KEYS: (record, stored result) per job, then the pending set, then (optional) the in-flight
-- hash of the worker that holds the jobs' messages. ARGV (after the two of every job script):
-- finished_at, result ttl, model version ('' : none), then per job: status, stored result,
-- error ('' : none), webhook list ('' : none), webhook message, the webhook queue's wake-up
-- list, the token of the message that ran it, the webhook delivery's id (recorded: the one
-- delivery delivery_claim.lua lets through), its message's delivery tag on the in-flight hash
-- ('' : none). With the hash, every job's message is acknowledged (HDEL) last, once every job
-- is final, whether this call finished it or found it finished (or not its own): the worker
-- acknowledges them all after a finish, and so a batch's results and acknowledgements take
-- one round trip, a result always stored before its message leaves. Returns, per job, 1 when it took its terminal
-- status here, 0 when it already had one (or the message was not the job's own). The jobs it
-- finished are announced on the moves channel, "done <id> <id> ...", in one message (as are a
-- cancel's and an expiry's, one job). Before that, a job whose record names a reply channel
-- (an API process waiting on it: `Prefer: wait`, job_submit.lua's 'reply') is announced there
-- with what a read would answer, so that the waiting process needs no read: per job
-- "<id> <bytes of the fields> <bytes of the result>\n", the record's FIELDS as a JSON array
-- (false for a field it lacks), then the stored result ('' but for a success); one message a
-- channel a batch. A result over REPLY_MAX_BYTES is not sent (its waiter reads it, woken by the
-- "done"): a subscriber's output buffer stays small. The finished record drops the field.
-- A finished record keeps what a read needs (and its token, so that a message sent by hand
-- with its id is still told apart): not its message, deadline or request. That of a job that
-- succeeded is written afresh (DEL, HSET, EXPIRE: it lives job_ttl_s from its finish),
-- compact: Redis keeps a hash that once held a large value (the message) in its large encoding
-- for good, one written with small values only takes its compact one (a listpack). The batch's
-- succeeded records go in one DEL, after every job was decided; what their reply channel is sent
-- is what was written, not read back. One that did not succeed drops the fields (its error is
-- seldom small).
-- KEEP (a constant): the fields of a record not final yet that its finished record keeps when
-- the job succeeds, status and token first.
-- #include _compact
local out, done, writes, gone, reply, replies = {}, {}, {}, {}, {}, {}
local ttl = tonumber(ARGV[4])
-- Read beside them: 'req', the size of the request an earlier release's submit kept in a key
-- of its own (dead() in the prelude), for a success to drop that key as that release did.
-- And 'charged', what the owner's books hold for a job whose request was not kept (job_submit).
local READ = {unpack(KEEP)}
READ[#READ + 1] = 'reply'
READ[#READ + 1] = 'req'
READ[#READ + 1] = 'charged'
local jobs = math.floor((#KEYS - 1) / 2)
local pending, inflight = KEYS[2 * jobs + 1], KEYS[2 * jobs + 2]
-- Whether an owner has quota books (_owner_books.lua) that a request may count on: asked once
-- an owner a call, so that a job whose owner has none (no quota: the default) costs neither the
-- length of its request nor a ZREM that finds nothing.
local books = {}
local function has_books(owner)
  if books[owner] == nil then books[owner] = redis.call('exists', KEPT_BY_PREFIX .. owner) == 1 end
  return books[owner]
end
local ids = {}
for i = 1, jobs do
  local key, a = KEYS[2 * i - 1], 5 + 9 * (i - 1)
  local id = id_of(key)
  ids[i] = id
  local f = redis.call('hmget', key, unpack(READ))
  local status = f[1]
  out[i] = 0
  if (status == 'queued' or status == 'running') and (not f[2] or f[2] == ARGV[a + 7])
      and not writes[key] then
    local v = {}
    if ARGV[a + 1] == 'succeeded' then
      for j = 2, #KEEP do if f[j] then v[KEEP[j]] = f[j] end end
      gone[#gone + 1] = key
      if has_books(v.owner or '') then  -- its request leaves with it, and the owner's books
        local size = redis.call('hstrlen', key, 'request')
        if size > 0 then release_owner_kept(v.owner or '', id, size) end
      end
      if f[#READ] then release_owner_kept(v.owner or '', id, f[#READ]) end
      if f[#READ - 1] then gone[#gone + 1] = KEPT_REQUEST .. id end
    end
    -- Its status, and its model version, error and webhook delivery's id if any.
    v.status, v.finished_at = ARGV[a + 1], ARGV[3]
    if ARGV[5] ~= '' then v.model_version = ARGV[5] end
    if ARGV[a + 3] ~= '' then v.error = ARGV[a + 3] end
    if ARGV[a + 4] ~= '' then v.webhook_id = ARGV[a + 8] end
    if ARGV[a + 1] == 'succeeded' then compact(v, ARGV[3]) end
    writes[key], out[i], reply[i] = v, 1, f[#READ - 2]
  end
end
if #gone > 0 then redis.call('del', unpack(gone)) end
for i = 1, jobs do
  local key, meta_key, a, id = KEYS[2 * i - 1], KEYS[2 * i], 5 + 9 * (i - 1), ids[i]
  if out[i] == 1 then
    local v = writes[key]
    local fields = {'status', v.status}
    for name, value in pairs(v) do
      if name ~= 'status' then fields[#fields + 1] = name; fields[#fields + 1] = value end
    end
    redis.call('hset', key, unpack(fields))
    if ARGV[a + 1] == 'succeeded' then
      redis.call('expire', key, TTL_S)
    else
      redis.call('hdel', key, 'message', 'list', 'reply')
      dead(key, id)
    end
    redis.call('set', meta_key, ARGV[a + 2], 'EX', ttl)
    if ARGV[a + 4] ~= '' then
      redis.call('lpush', ARGV[a + 4], ARGV[a + 5])
      if redis.call('llen', ARGV[a + 6]) == 0 then redis.call('lpush', ARGV[a + 6], '1') end
    end
    done[#done + 1] = id
    local stored = ARGV[a + 1] == 'succeeded' and ARGV[a + 2] or ''
    if reply[i] and #stored <= REPLY_MAX_BYTES then
      local values
      if ARGV[a + 1] == 'succeeded' then  -- its record is what was written: nothing else
        values = {}
        for j = 1, #FIELDS do values[j] = v[FIELDS[j]] or false end
      else
        values = redis.call('hmget', key, unpack(FIELDS))
      end
      local fields = cjson.encode(values)
      local entries = replies[reply[i]] or {}
      entries[#entries + 1] = id .. ' ' .. #fields .. ' ' .. #stored .. '\n' .. fields
        .. stored
      replies[reply[i]] = entries
    end
  end
end
for channel, entries in pairs(replies) do
  redis.call('publish', channel, table.concat(entries))
end
if #done > 0 then
  redis.call('zrem', pending, unpack(done))
  redis.call('publish', MOVES_CHANNEL, 'done ' .. table.concat(done, ' '))
end
if inflight then
  local tags = {}
  for i = 1, jobs do
    local tag = ARGV[5 + 9 * (i - 1) + 9]
    if tag ~= '' then tags[#tags + 1] = tag end
  end
  if #tags > 0 then redis.call('hdel', inflight, unpack(tags)) end
end
return out
