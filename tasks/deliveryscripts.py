"""The Lua scripts of a job's webhook delivery (tasks/jobstate.py runs them, for
workers/webhooks.py): the claim an attempt makes before it sends (CLAIM_DELIVERY) and the mark
of a delivery answered for good (DELIVERY_DONE). FINISH (tasks/jobscripts.py) records the id of
the one delivery these let through.

They take the two common arguments of every job script (tasks/jobscripts.py) and run after its
prelude; their own arguments follow from ARGV[3]."""
from __future__ import annotations

from tasks.jobscripts import PRELUDE

# KEYS: record. ARGV: the event, the delivery's id. Returns a DeliveryClaim: 'deliver' (this
# is the job's one delivery, as FINISH recorded its id, and the event is the job's terminal
# status and one it asked for, and no attempt of it was answered for good yet), or why not:
# 'missing' (no record, or no webhook), 'not_its_status', 'not_asked', 'duplicate' (not the
# recorded id), 'done' (DELIVERY_DONE marked it). A record finished before FINISH recorded
# ids takes the first id that claims it.
CLAIM_DELIVERY = PRELUDE + """
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
"""

# KEYS: record. ARGV: the delivery's id, its final outcome. The job's delivery got an answer
# that ends it (delivered, refused, given up): CLAIM_DELIVERY lets no message through again,
# even one with its id. Returns 1, or 0 when the id is not the job's delivery.
DELIVERY_DONE = PRELUDE + """
if redis.call('hget', KEYS[1], 'webhook_id') ~= ARGV[3] then return 0 end
redis.call('hset', KEYS[1], 'webhook_done', ARGV[4])
return 1
"""
