"""The Lua scripts of the worker's fetch, in-flight record and recovery, one file each in
workers/broker/lua/ (read at import by tasks/lua.py's loader). Each is one atomic step
inside Redis, so that a message is on its queue, on a worker's in-flight record or (a webhook
retry) in its queue's delayed set at every instant, whatever happens to the worker or to the
connection between two steps.

Keys (besides the queue lists, `tasks.keys` and the job records):

    iq:inflight:<incarnation>  hash: delivery tag -> "<queue list>\\n<message>", what one worker
                               process took and has not acknowledged or put back
    iq:alive:<incarnation>     its lease: a key whose expiry (Redis's clock) the worker pushes
                               forward every heartbeat; gone = the worker stopped beating
    iq:fetchers                hash: incarnation -> node name, every worker that may hold
                               messages, for the recovery to look at

Writes a full Redis refuses (`noeviction`) are the ones flagged `denyoom` (SET, HSET, RPUSH,
...) and only as a script's first write: each script here that must work while Redis is full
starts its writes with a removal (LTRIM, HDEL, DEL, ZREM), so that a move goes through whole;
the lease (PEXPIRE) is never refused.
"""
from __future__ import annotations

from pathlib import Path

from tasks import queuemoves
from tasks.keys import JOB_PREFIX, PREFIX, wake_key
from tasks.lua import script
from tasks.names import PRIORITY_SEP

INFLIGHT_PREFIX = f"{PREFIX}inflight:"
ALIVE_PREFIX = f"{PREFIX}alive:"
FETCHERS_KEY = f"{PREFIX}fetchers"
RECONCILE_MUTEX = f"{PREFIX}reconcile:mutex"
# Messages a fetch could not read (not JSON, or no delivery tag): kept aside, not delivered.
MALFORMED_KEY = f"{PREFIX}malformed"

FOLDER = Path(__file__).with_name("lua")
# What the scripts are given, by the names they use (those of tasks/lua/_queue_forward.lua
# too, which lua/_inflight.lua includes).
CONSTANTS = {**queuemoves.CONSTANTS, "SEP": PRIORITY_SEP, "WAKE": wake_key(""),
             "INFLIGHT": INFLIGHT_PREFIX, "ALIVE": ALIVE_PREFIX, "JOB_PREFIX": JOB_PREFIX,
             "MALFORMED": MALFORMED_KEY}


FETCH = script("inflight_fetch", CONSTANTS, FOLDER)
BEAT = script("inflight_beat", CONSTANTS, FOLDER)
RESTORE = script("inflight_restore", CONSTANTS, FOLDER)
REAP = script("inflight_reap", CONSTANTS, FOLDER)
RECONCILE = script("inflight_reconcile", CONSTANTS, FOLDER)
LATER = script("inflight_later", CONSTANTS, FOLDER)
