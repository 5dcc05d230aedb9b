"""Every Redis key and channel name the API and the workers share, besides Celery's and kombu's
own. One place, so that a name cannot drift between the two sides."""
from __future__ import annotations

import hashlib
import json
import re

PREFIX = "iq:"
JOB_PREFIX = f"{PREFIX}job:"
# Pub/sub channels `iq:done:<job id>`, on which workers of earlier releases announced a job's
# move to a terminal status, one job a message; the API still listens to them (app/waiter.py)
# while such workers may run.
DONE_PREFIX = f"{PREFIX}done:"
# Pub/sub channel on which jobs' moves are announced, a batch at a time (ids only, never a
# result): "running <id> <id> ..." when a batch starts, "progress <id> ..." when a job spanning
# several model calls has more items done, "done <id> ..." when jobs reach a terminal status
# (a batch's finish, a cancel, an expiry). The API's waiting requests and event streams listen
# (app/waiter.py, app/events.py).
MOVES_CHANNEL = f"{PREFIX}moves"
# Pub/sub channels `iq:reply:<token>`, one an API process (and Redis group): a job submitted
# with `Prefer: wait` names its process's in its record, and the finish announces the job there,
# record and result, before its "done" (tasks/lua/_finish.lua), so that the wait needs no read.
REPLY_PREFIX = f"{PREFIX}reply:"
# The kept requests of jobs that did not succeed (tasks/jobstate.py): a sorted set of
# "<job id>:<bytes>" by the time each is dropped, and the bytes they hold in all.
KEPT_KEY = f"{PREFIX}kept"
KEPT_BYTES_KEY = f"{PREFIX}kept:bytes"
# The requests Redis keeps for one owner (an API key's name), its quota's books
# (IQ_KEPT_BYTES_PER_KEY): a sorted set of "<job id>:<bytes>" by the time each leaves Redis at
# the latest (a waiting job's: its record's end; one kept for a retry: its key's), and the bytes
# they hold in all, each changed only beside its member's ZADD or ZREM (tasks/lua/).
KEPT_BY_PREFIX = f"{PREFIX}keptby:"
KEPT_BY_BYTES_PREFIX = f"{PREFIX}keptby-bytes:"
# Celery's Redis result backend names a task's result key (and channel) this way.
RESULT_PREFIX = "celery-task-meta-"


def job_key(job_id: str) -> str:
    """The job record (a hash): see tasks/jobstate.py for its fields."""
    return f"{JOB_PREFIX}{job_id}"


def result_key(job_id: str) -> str:
    """The job's stored result (tasks/results.py), where Celery's backend keeps a task's:
    readable with AsyncResult too."""
    return f"{RESULT_PREFIX}{job_id}"


def owner_jobs(owner: str) -> str:
    """The jobs of one owner (an API key's name; "" when keys are off), newest first: a list
    of 23-byte entries, each a job's submission time (microseconds, Redis's clock) and its id
    (tasks/lua/_owned.lua), trimmed as their records expire. ~24 bytes a job, where a sorted
    set's member takes ~135."""
    return f"{PREFIX}jobs:{owner}"


_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def owned_id(job_id: str) -> bytes:
    """A job id as its `owner_jobs` entry keeps it: the 16 bytes a lowercase UUID's canonical
    text stands for, or b"" for any other id (the entry keeps its text). Packed here, once, and
    given to the submit script (tasks/lua/_owned.lua's owned_entry), where the same work took
    Redis ~3.5 µs a job of Lua's string calls."""
    return bytes.fromhex(job_id.replace("-", "")) if _CANONICAL_UUID.fullmatch(job_id) else b""


def owner_index(owner: str) -> str:
    """The jobs of one owner as releases before this one indexed them: a sorted set of job
    ids by submission time (microseconds, Redis's clock). Still listed, beside `owner_jobs`,
    and trimmed, until its last entry is a day old; written only by API processes of those
    releases (during an upgrade)."""
    return f"{PREFIX}owner:{owner}"


def dead_index(owner: str) -> str:
    """The owner's jobs that ended without succeeding (failed, cancelled, expired): a sorted
    set of job ids by the time each ended: the dead-letter view."""
    return f"{PREFIX}dead:{owner}"


def kept_request(job_id: str) -> str:
    """The request of a job that did not succeed, kept for a retry (JSON, expiring)."""
    return f"{PREFIX}request:{job_id}"


def idempotency_key(owner: str, key: str) -> str:
    """The claim of an Idempotency-Key, scoped to its API key: hashed from both as a JSON pair,
    so that no owner/key split can collide with another ("ops" + "batch:k1" is not
    "ops:batch" + "k1")."""
    digest = hashlib.sha256(json.dumps([owner, key]).encode()).hexdigest()
    return f"{PREFIX}idem:{digest}"


def live_key(model: str) -> str:
    """Sorted set of pool children that have the model loaded (`hostname/index`), scored by
    their last heartbeat."""
    return f"{PREFIX}live:{model}"


def versions_key(model: str) -> str:
    """Hash of the version of the model each pool child serves: field `hostname/index` (a
    member of live_key), value the version (workers/child/versions.py)."""
    return f"{PREFIX}versions:{model}"


# Sorted set of workers (hostname) whose main process is consuming, scored by the last tick of
# its event loop. A child's heartbeat alone says the model is loaded, not that jobs reach it.
CONSUMING_KEY = f"{PREFIX}consuming"

# The models file revision the last reload announced (scripts/reload.py): every process whose
# own file has that revision reloads it.
MODELS_REVISION_KEY = f"{PREFIX}models:revision"
# How many times a revision was announced, counted by each announcement with it: a worker that
# refused a revision (a failed load, workers/batching/reload.py) begins it again once it is
# announced again, an operator having fixed what failed.
MODELS_ANNOUNCEMENTS_KEY = f"{PREFIX}models:announcements"
# How many jobs ended `model_removed` on this Redis, ever (tasks/jobstate.py `finish`, by a
# worker as it meets them and by `make reload`'s sweep): a reload reports the difference.
REMOVED_FAILED_KEY = f"{PREFIX}models:removed-failed"
# Hash of where each process stands with the models file: field `worker:<node name>` or
# `api:<host>/<pid>`, value JSON {"revision", "state", "at", ...} (workers/batching/reload.py,
# app/reloading.py); a reload waits on it.
RELOAD_STATUS_KEY = f"{PREFIX}reload:status"
# Hash of the gunicorns serving the API: field `<host> <address>`, value JSON {"processes",
# "at"}, written by each of its processes every heartbeat (app/reloading.py) and kept when they
# exit: a reload is done once as many processes serve the new revision there as before, also
# when none was up as it began (its master restarting).
RELOAD_API_KEY = f"{PREFIX}reload:api"


def reload_turn_key(queue: str) -> str:
    """The worker whose turn it is to reload its last serving child of `queue`'s (its node
    name, expiring unless renewed): the workers serving a queue reload one after another
    (workers/batching/turns.py)."""
    return f"{PREFIX}reload:turn:{queue}"


def reload_failed_key(revision: str) -> str:
    """A models file revision that a reload's new pool child could not load: JSON {"worker",
    "error" (one line), "at"}, written by that child (tasks/reload_failures.py), expiring after a
    day. Every worker on that revision rolls back to the one it served and refuses it since;
    `make reload` reports it, and clears it when it announces the revision again."""
    return f"{PREFIX}reload:failed:{revision}"


# Hash of the queues a reload took a model off: old queue -> the model's new queue. What
# waits on the old queue, or is handed back to it (a worker's buffer, a reaped worker's
# messages, the reconciler), goes to the new one once no worker consumes the old
# (tasks/queuemoves.py). An entry goes when a models file gives its queue to a model again.
QUEUE_MOVES_KEY = f"{PREFIX}queue:moves"


def consuming_key(queue: str) -> str:
    """Sorted set of the workers (hostname) consuming `queue` now, scored by their last tick:
    a worker told to stop consuming a queue (`cancel_consumer`) leaves it at its next tick."""
    return f"{CONSUMING_KEY}:{queue}"


def wake_key(queue: str) -> str:
    """A list of wake-up tokens for the workers that consume `queue`: whoever puts a message
    on the queue while it was empty adds one (at most one waits), and an idle worker blocks on
    it (BRPOP) instead of polling. A token carries nothing: one lost costs a worker a short
    poll, never a job (workers/broker/fetch.py)."""
    return f"{PREFIX}wake:{queue}"


def delayed_key(queue: str) -> str:
    """Sorted set of `queue`'s messages that wait for a later time (scored by Redis's clock,
    in seconds): a fetch moves the due ones onto the queue (webhook retries)."""
    return f"{PREFIX}delayed:{queue}"


# Sorted set of the jobs that are not final yet (queued or running), scored by Redis's clock
# when they were submitted or last looked at: the reconciler's list of jobs to check
# (workers/broker/lua.py).
PENDING_KEY = f"{PREFIX}pending"


def unhealthy_key(model: str) -> str:
    """Sorted set of workers (hostname) whose instances of `model` must not count as live
    (their pool children crash-loop, or a batch ran past its time limit), each scored by
    Redis's clock until when."""
    return f"{PREFIX}unhealthy:{model}"
