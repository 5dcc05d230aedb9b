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
-- with what a read would answer, so that the waiting process needs no read; one message a
-- channel a batch, an entry a job, "<key> <bytes of the fields> <bytes of the result>\n", the
-- fields, then the stored result ('' but for a success). A job that succeeded: key
-- "2/<n>/<id>", the fields its record was just written with (the whole record), names and
-- values, n strings joined by NUL (table.concat: a JSON encoding cost Redis ~11k instructions
-- a job); an API process of the release before skips an entry whose key is no job it waits on,
-- and reads the job when its "done" wakes it. Another: key "<id>", the record's FIELDS as a
-- JSON array (false for a field it lacks), as every release sends and reads
-- (tasks/jobstate.py `announced`). A result over REPLY_MAX_BYTES is not sent (its waiter reads
-- it, woken by the "done"): a subscriber's output buffer stays small. The finished record
-- drops the field.
-- A finished record keeps what a read needs (and its token, so that a message sent by hand
-- with its id is still told apart): not its message, deadline or request. That of a job that
-- succeeded is written afresh (DEL, HSET, EXPIRE: it lives job_ttl_s from its finish),
-- compact: Redis keeps a hash that once held a large value (the message) in its large encoding
-- for good, one written with small values only takes its compact one (a listpack). The batch's
-- succeeded records go in one DEL, after every job was decided; what their reply channel is sent
-- is what was written, not read back. One that did not succeed drops the fields (its error is
-- seldom small).
-- SUCCEEDED_READ (a constant, tasks/job_lua.py): the fields of a record not final yet that its
-- succeeded record keeps, read into locals by position (a table keyed by name, filled and then
-- walked, cost Redis ~3 µs a job), then 'reply', 'req' and 'charged'. Not read: the fields only
-- a final record holds (finished_at, error, model_version, retried_as, kept), since only a
-- queued or running job is finished here.
-- #include _compact
local out, done, lists, gone, reply, replies = {}, {}, {}, {}, {}, {}
-- The results' time to live as a command's argument (_job_prelude's whole_text).
local ttl = whole_text(ARGV[4])
local finished_ms = tonumber(ARGV[3])
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
local version = ARGV[5] ~= '' and ARGV[5] or false
local ids, taken = {}, {}
for i = 1, jobs do
  local key, a = KEYS[2 * i - 1], 5 + 9 * (i - 1)
  local id = id_of(key)
  ids[i] = id
  local status, token, model, created, trace, inputs, priority, owner, format, hook_url,
        hook_events, started, worker, batch, runs, items_done, retry_of, crashes, channel, req,
        charged = unpack(redis.call('hmget', key, unpack(SUCCEEDED_READ)))
  out[i] = 0
  if (status == 'queued' or status == 'running') and (not token or token == ARGV[a + 7])
      and not taken[key] then
    local error = ARGV[a + 3] ~= '' and ARGV[a + 3] or false
    local hook_id = ARGV[a + 4] ~= '' and ARGV[a + 8] or false
    if ARGV[a + 1] == 'succeeded' then
      gone[#gone + 1] = key
      if has_books(owner or '') then  -- its request leaves with it, and the owner's books
        local size = redis.call('hstrlen', key, 'request')
        if size > 0 then release_owner_kept(owner or '', id, size) end
      end
      if charged then release_owner_kept(owner or '', id, charged) end
      if req then gone[#gone + 1] = KEPT_REQUEST .. id end
      lists[i] = succeeded(ARGV[3], finished_ms, version, error, hook_id, token, model,
        created, trace, inputs, priority, owner, format, hook_url, hook_events, started,
        worker, batch, runs, items_done, retry_of, crashes)
    else
      -- Its status, and its model version, error and webhook delivery's id if any.
      local w = {'status', ARGV[a + 1], 'finished_at', ARGV[3]}
      if version then w[5], w[6] = 'model_version', version end
      if error then w[#w + 1], w[#w + 2] = 'error', error end
      if hook_id then w[#w + 1], w[#w + 2] = 'webhook_id', hook_id end
      lists[i] = w
    end
    taken[key], out[i], reply[i] = true, 1, channel
  end
end
if #gone > 0 then redis.call('del', unpack(gone)) end
for i = 1, jobs do
  local key, meta_key, a, id = KEYS[2 * i - 1], KEYS[2 * i], 5 + 9 * (i - 1), ids[i]
  if out[i] == 1 then
    redis.call('hset', key, unpack(lists[i]))
    if ARGV[a + 1] == 'succeeded' then
      redis.call('expire', key, TTL_TEXT)
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
      local entries = replies[reply[i]] or {}
      -- (Numbers by %d: a number concatenated is written with %.14g, a float's path.)
      if ARGV[a + 1] == 'succeeded' then  -- its record is what was written, nothing else
        local fields = table.concat(lists[i], '\0')
        entries[#entries + 1] = string.format('2/%d/', #lists[i]) .. id
          .. string.format(' %d %d\n', #fields, #stored) .. fields .. stored
      else
        local fields = cjson.encode(redis.call('hmget', key, unpack(FIELDS)))
        entries[#entries + 1] = id .. string.format(' %d %d\n', #fields, #stored) .. fields
      end
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
