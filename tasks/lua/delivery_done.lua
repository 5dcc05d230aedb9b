-- The mark of a webhook delivery answered for good (tasks/jobstate.py `delivery_done`).
-- KEYS: record. ARGV (after the two of every job script): the delivery's id, its final
-- outcome. The job's delivery got an answer that ends it (delivered, refused, given up):
-- delivery_claim.lua lets no message through again, even one with its id. Returns 1, or 0
-- when the id is not the job's delivery.
-- #include _job_prelude
if redis.call('hget', KEYS[1], 'webhook_id') ~= ARGV[3] then return 0 end
redis.call('hset', KEYS[1], 'webhook_done', ARGV[4])
return 1
