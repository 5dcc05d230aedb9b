"""The Lua scripts that move a job (tasks/jobstate.py runs them), one file each in tasks/lua/
(job_*.lua, delivery_*.lua, on the prelude _job_prelude.lua), read once at import and given the
constants they share: the key prefixes of tasks/keys.py and the record's field names, which are
the ones `JobRecord` reads and writes. Each move is decided once, inside Redis.

Every script takes two common arguments first, ARGV[1] and ARGV[2]: how long the request of a
job that did not succeed is kept for a retry (seconds; 0: none is kept) and the records' time
to live (`job_ttl_s`); its own arguments follow from ARGV[3]."""
from __future__ import annotations

from tasks.keys import (JOB_PREFIX, KEPT_BY_BYTES_PREFIX, KEPT_BY_PREFIX, KEPT_BYTES_KEY,
                        KEPT_KEY, MOVES_CHANNEL, dead_index, kept_request, owner_index)
from tasks.lua import script

# The fields a read returns. (Not a job's request, kept for a retry: inputs can weigh a
# megabyte and only a retry reads them.) The last four are those of a succeeded job's record as
# FINISH writes it (tasks/lua/_compact.lua), in place of the fields they pack.
READ_FIELDS = ("status", "model", "created_at", "trace_id", "inputs", "priority", "owner",
               "encoding_format", "webhook_url", "webhook_events", "token", "expires_at",
               "started_at", "finished_at", "worker", "batch", "runs", "error", "items_done",
               "retry_of", "retried_as", "kept", "model_version", "r", "t", "w", "v")
# The fields of a record not final yet that its finished record keeps when the job succeeds
# (FINISH writes it afresh): the record's but its message, list, deadline and request. Status
# and token first. Of them, those only a final record holds: FINISH, which finishes only a
# queued or running job, does not read them.
KEEP_FIELDS = ("status", "token", *(name for name in READ_FIELDS[:READ_FIELDS.index("r")]
                                    if name not in ("status", "token", "expires_at")),
               "crashes")
FINAL_ONLY = ("finished_at", "error", "model_version", "retried_as", "kept")

# What FINISH reads of a record not final yet (tasks/lua/_finish.lua), in this order, into
# locals: what a succeeded record keeps (KEEP_FIELDS but FINAL_ONLY), then the reply channel,
# an earlier release's kept request's size and what the owner's books hold. By position: a
# field added to a record is added here and to _finish.lua's and _compact.lua's locals
# (tests/integration/test_script_arguments.py checks that none is left out).
SUCCEEDED_READ = ("status", "token", "model", "created_at", "trace_id", "inputs", "priority",
                  "owner", "encoding_format", "webhook_url", "webhook_events", "started_at",
                  "worker", "batch", "runs", "items_done", "retry_of", "crashes", "reply", "req",
                  "charged")

# What a submit names in the place of the record of the job it retries when it retries none
# (tasks/lua/_submit.lua tells a retry by it): one key for every job, never written.
NO_RETRY = f"{JOB_PREFIX}:no-retry"
# What a submit names in the place of its idempotency claim when it has no Idempotency-Key (the
# script reads and writes the claim only with a key's digest): one key for every job, never
# written, and one string Lua keeps for a whole call.
NO_CLAIM = f"{JOB_PREFIX}:no-claim"

# The largest stored result a finish sends to the API process waiting on its job (its reply
# channel, tasks/lua/_finish.lua); a larger one is read by the waiter as before.
REPLY_MAX_BYTES = 64 * 1024

# What the job scripts are given, by the names they use.
CONSTANTS = {"FIELDS": READ_FIELDS, "SUCCEEDED_READ": SUCCEEDED_READ, "JOB_PREFIX": JOB_PREFIX,
             "KEPT_KEY": KEPT_KEY, "KEPT_BYTES_KEY": KEPT_BYTES_KEY,
             "KEPT_BY_PREFIX": KEPT_BY_PREFIX, "KEPT_BY_BYTES_PREFIX": KEPT_BY_BYTES_PREFIX,
             "DEAD_INDEX": dead_index(""), "OWNER_INDEX": owner_index(""),
             "KEPT_REQUEST": kept_request(""), "MOVES_CHANNEL": MOVES_CHANNEL,
             "REPLY_MAX_BYTES": REPLY_MAX_BYTES, "NO_RETRY": NO_RETRY}

# Each script's text, by the name its move goes by (tasks/jobstate.py's `JobState._run`).
SUBMIT = script("job_submit", CONSTANTS)
SUBMIT_MANY = script("job_submit_many", CONSTANTS)
START = script("job_start", CONSTANTS)
PROGRESS = script("job_progress", CONSTANTS)
FINISH = script("job_finish", CONSTANTS)
FINISH_QUEUED = script("job_finish_queued", CONSTANTS)
CANCEL = script("job_cancel", CONSTANTS)
READ = script("job_read", CONSTANTS)
CRASHED = script("job_crashed", CONSTANTS)
LIST = script("job_list", CONSTANTS)
DELETE = script("job_delete", CONSTANTS)
KEPT = script("job_kept", CONSTANTS)
CLAIM_DELIVERY = script("delivery_claim", CONSTANTS)
DELIVERY_DONE = script("delivery_done", CONSTANTS)

SCRIPTS = {"submit": SUBMIT, "submit_many": SUBMIT_MANY, "start": START, "progress": PROGRESS,
           "finish": FINISH, "finish_queued": FINISH_QUEUED, "cancel": CANCEL, "read": READ, "crashed": CRASHED,
           "list": LIST, "delete": DELETE, "kept": KEPT, "claim_delivery": CLAIM_DELIVERY,
           "delivery_done": DELIVERY_DONE}
