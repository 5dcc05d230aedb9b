-- The claim a webhook delivery's attempt makes before it sends (tasks/jobstate.py
-- `claim_delivery`, for deliverer/webhooks.py). job_finish.lua records the id of the one
-- delivery this lets through.
-- KEYS: record. ARGV (after the two of every job script): the event, the delivery's id.
-- Returns a DeliveryClaim: 'deliver' (this is the job's one delivery, as job_finish recorded
-- its id, and the event is the job's terminal status and one it asked for, and no attempt of
-- it was answered for good yet), or why not: 'missing' (no record, or no webhook),
-- 'not_its_status', 'not_asked', 'duplicate' (not the recorded id), 'done' (delivery_done.lua
-- marked it). A record finished before job_finish recorded ids takes the first id that claims
-- it.
-- #include _job_prelude
local f = redis.call('hmget', KEYS[1], 'status', 'webhook_url', 'webhook_events', 'webhook_id',
                     'webhook_done')
if not f[1] or not f[2] then return 'missing' end
if f[1] ~= ARGV[3] then return 'not_its_status' end
if f[3] and not string.find(',' .. f[3] .. ',', ',' .. ARGV[3] .. ',', 1, true) then
  return 'not_asked'
end
if f[4] and f[4] ~= ARGV[4] then return 'duplicate' end
if f[5] then return 'done' end
redis.call('hset', KEYS[1], 'webhook_id', ARGV[4])
return 'deliver'
