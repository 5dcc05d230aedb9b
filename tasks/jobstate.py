"""The one owner of a job's state: its record in Redis, its status machine and the scripts that
move it. The API and the workers both go through here; nothing else writes a job record.

    queued ──▶ running ──▶ succeeded | failed
      │           │
      │           └──▶ running again, only when its message comes back after its pool child
      │                or worker was lost
      └──▶ cancelled | expired

Every move is one Lua script, so each is decided once, inside Redis:

* `submit`: the idempotency claim, the queue-depth check, the record and the enqueue of the
  task message are one decision. N concurrent submits with one Idempotency-Key give one job,
  and no record can exist whose message was never queued.
* `start`: a batch's jobs become `running` unless they were cancelled, expired or already
  finished (a redelivered message whose result exists is not run again). Expiry is decided by
  Redis's clock, here and in `read`, never by a client's.
* `finish`: only a job that is not terminal takes its terminal status; its result (Celery's
  result meta, so that AsyncResult and Flower still read it) and its webhook delivery are
  written in the same step, so a duplicate run can change nothing and a webhook is queued once.
* `cancel`: only a queued job is cancelled; `start` refuses a cancelled one.

A terminal status is final: no later script changes it or its timestamps.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

import orjson
import redis

from tasks.keys import DONE_PREFIX, JOB_PREFIX, done_channel, job_key, result_key
from tasks.messages import QueuedMessage


class Status(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.EXPIRED})


@dataclass(frozen=True)
class JobError:
    """Why a job failed (or did not run): a stable code and a message for people."""
    code: str
    message: str

    def to_json(self) -> str:
        return orjson.dumps({"code": self.code, "message": self.message}).decode()


CANCELLED_ERROR = JobError("cancelled", "the job was cancelled before it ran")
EXPIRED_ERROR = JobError("expired", "the job was not started before its deadline")


class Overloaded(Exception):
    """The model's queue is at its configured depth."""


class IdempotencyMismatch(Exception):
    """An Idempotency-Key was reused with a different request body."""


class StoreFull(Exception):
    """Redis is within its headroom of maxmemory: new jobs are refused so that the accepted
    ones keep room for their results."""

    def __init__(self, used: int, cap: int) -> None:
        super().__init__(f"Redis holds {used / 2**20:.1f} of its {cap / 2**20:.1f} MiB")
        self.used, self.cap = used, cap


@dataclass(frozen=True)
class Final:
    """A job's terminal outcome as a worker reports it to `finish`."""
    job_id: str
    status: Status  # SUCCEEDED or FAILED
    meta: bytes  # Celery's result meta, JSON
    error: JobError | None = None
    webhook: QueuedMessage | None = None


@dataclass
class JobRecord:
    """A job as read back: the record's fields and, once it finished, Celery's result meta."""
    id: str
    fields: dict[str, str]
    meta: dict[str, Any] | None = None

    @property
    def status(self) -> Status:
        return Status(self.fields["status"])

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def error(self) -> JobError | None:
        raw = self.fields.get("error")
        if not raw:
            return None
        data = orjson.loads(raw)
        return JobError(data["code"], data["message"])

    @property
    def outputs(self) -> list | None:
        result = (self.meta or {}).get("result")
        return result.get("outputs") if isinstance(result, dict) else None


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# Redis's own clock, for deadlines: one clock for every process that decides expiry.
# (redis.replicate_commands lets a script write after reading TIME on Redis 6; a no-op on 7+.)
_CLOCK = """
redis.replicate_commands()
local t = redis.call('time')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""

# Expire a queued job whose deadline passed: KEY is the record, `id` its job id.
_EXPIRE_IF_DUE = """
local function expire_if_due(key, id, status, expires_at, finished_at, error)
  if status == 'queued' and expires_at and expires_at ~= '' and now > tonumber(expires_at) then
    redis.call('hset', key, 'status', 'expired', 'finished_at', finished_at, 'error', error)
    redis.call('publish', '""" + DONE_PREFIX + """' .. id, 'expired')
    return true
  end
  return false
end
"""

_ID_OF = f"local function id_of(key) return string.sub(key, {len(JOB_PREFIX) + 1}) end\n"

# KEYS: record, idempotency claim, target list, then the model's queue lists (for its depth).
# ARGV: job id, ttl, max depth, timeout_s (0: none), request digest ('' : no idempotency key),
#       message, memory headroom (share of maxmemory kept free), then the record's field/value
#       pairs.
_SUBMIT = _CLOCK + """
local ttl = tonumber(ARGV[2])
local memory = redis.call('info', 'memory')
local cap = tonumber(string.match(memory, 'maxmemory:(%d+)'))
local used = tonumber(string.match(memory, 'used_memory:(%d+)'))
if cap > 0 and used > (1 - tonumber(ARGV[7])) * cap then
  return {'full', used .. ' ' .. cap}
end
if ARGV[5] ~= '' then
  local earlier = redis.call('get', KEYS[2])
  if earlier then
    local sep = string.find(earlier, ' ', 1, true)
    if string.sub(earlier, sep + 1) ~= ARGV[5] then return {'mismatch', ''} end
    return {'existing', string.sub(earlier, 1, sep - 1)}
  end
end
local depth = 0
for i = 4, #KEYS do depth = depth + redis.call('llen', KEYS[i]) end
if depth >= tonumber(ARGV[3]) then return {'overloaded', ''} end
local fields = {'status', 'queued'}
for i = 8, #ARGV do fields[#fields + 1] = ARGV[i] end
local timeout = tonumber(ARGV[4])
if timeout > 0 then
  fields[#fields + 1] = 'expires_at'
  fields[#fields + 1] = string.format('%.3f', now + timeout)
end
redis.call('hset', KEYS[1], unpack(fields))
redis.call('expire', KEYS[1], ttl)
if ARGV[5] ~= '' then redis.call('set', KEYS[2], ARGV[1] .. ' ' .. ARGV[5], 'EX', ttl) end
redis.call('lpush', KEYS[3], ARGV[6])
return {'created', ARGV[1]}
"""

# KEYS: the batch's records. ARGV: started_at, worker, batch (JSON), finished_at, expired error.
# Returns, per job: 'run', or why it must not run ('missing', 'cancelled', 'expired', or the
# status it already ended with).
_START = _CLOCK + _EXPIRE_IF_DUE + _ID_OF + """
local out = {}
for i, key in ipairs(KEYS) do
  local f = redis.call('hmget', key, 'status', 'expires_at')
  local status = f[1]
  if not status then
    out[i] = 'missing'
  elseif expire_if_due(key, id_of(key), status, f[2], ARGV[4], ARGV[5]) then
    out[i] = 'expired'
  elseif status == 'queued' or status == 'running' then
    redis.call('hset', key, 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2],
               'batch', ARGV[3])
    redis.call('hincrby', key, 'runs', 1)
    out[i] = 'run'
  else
    out[i] = status
  end
end
return out
"""

# KEYS: (record, result meta) per job. ARGV: finished_at, result ttl, then per job: status,
# meta, error ('' : none), webhook list ('' : none), webhook message.
# Returns, per job, 1 when it took its terminal status here, 0 when it already had one.
_FINISH = _ID_OF + """
local out = {}
local ttl = tonumber(ARGV[2])
for i = 1, #KEYS / 2 do
  local key, meta_key, a = KEYS[2 * i - 1], KEYS[2 * i], 2 + 5 * (i - 1)
  local status = redis.call('hget', key, 'status')
  if status == 'queued' or status == 'running' then
    redis.call('hset', key, 'status', ARGV[a + 1], 'finished_at', ARGV[1])
    if ARGV[a + 3] ~= '' then redis.call('hset', key, 'error', ARGV[a + 3]) end
    redis.call('set', meta_key, ARGV[a + 2], 'EX', ttl)
    if ARGV[a + 4] ~= '' then redis.call('lpush', ARGV[a + 4], ARGV[a + 5]) end
    redis.call('publish', '""" + DONE_PREFIX + """' .. id_of(key), ARGV[a + 1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# KEYS: record. ARGV: now (ISO), cancelled error, expired error.
_CANCEL = _CLOCK + _EXPIRE_IF_DUE + _ID_OF + """
local f = redis.call('hmget', KEYS[1], 'status', 'expires_at')
local status = f[1]
if not status then return 'missing' end
if expire_if_due(KEYS[1], id_of(KEYS[1]), status, f[2], ARGV[1], ARGV[3]) then
  return 'expired'
end
if status ~= 'queued' then return status end
redis.call('hset', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[1], 'error', ARGV[2])
redis.call('publish', '""" + DONE_PREFIX + """' .. id_of(KEYS[1]), 'cancelled')
return 'ok'
"""

# KEYS: record, result meta. ARGV: now (ISO), expired error. Returns {fields, meta or false}.
_READ = _CLOCK + _EXPIRE_IF_DUE + _ID_OF + """
local f = redis.call('hmget', KEYS[1], 'status', 'expires_at')
if not f[1] then return {} end
expire_if_due(KEYS[1], id_of(KEYS[1]), f[1], f[2], ARGV[1], ARGV[2])
local meta = false
local status = redis.call('hget', KEYS[1], 'status')
if status == 'succeeded' or status == 'failed' then meta = redis.call('get', KEYS[2]) end
return {redis.call('hgetall', KEYS[1]), meta}
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Submitted:
    job_id: str
    created: bool


@dataclass
class JobState:
    """The status machine over one Redis client. Each method is one round trip."""
    client: redis.Redis
    _scripts: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, source in (("submit", _SUBMIT), ("start", _START), ("finish", _FINISH),
                             ("cancel", _CANCEL), ("read", _READ)):
            self._scripts[name] = self.client.register_script(source)

    def submit(self, job_id: str, record: Mapping[str, str], message: QueuedMessage, *,
               depth_lists: Sequence[str], max_depth: int, ttl_s: int, timeout_s: float = 0,
               idempotency: tuple[str, str] | None = None,
               memory_headroom: float = 0.0) -> Submitted:
        """Record the job and queue its message, or raise Overloaded, StoreFull or
        IdempotencyMismatch. With `idempotency` = (claim key, request digest) already claimed
        by an earlier request with the same digest, that earlier job's id and
        created=False."""
        claim, digest = idempotency or (job_key(job_id) + ":no-claim", "")
        args: list[Any] = [job_id, ttl_s, max_depth, timeout_s or 0, digest, message.payload,
                           memory_headroom]
        for name, value in record.items():
            args += [name, value]
        kind, found = (_text(x) for x in self._scripts["submit"](
            keys=[job_key(job_id), claim, message.list_key, *depth_lists], args=args))
        if kind == "overloaded":
            raise Overloaded()
        if kind == "full":
            used, cap = (int(x) for x in found.split())
            raise StoreFull(used, cap)
        if kind == "mismatch":
            raise IdempotencyMismatch()
        return Submitted(found, kind == "created")

    def start(self, job_ids: Sequence[str], *, worker: str, batch: str) -> list[str]:
        """Mark a batch's jobs running; per job 'run' or the reason it must not run."""
        now = now_iso()
        out = self._scripts["start"](keys=[job_key(j) for j in job_ids],
                                     args=[now, worker, batch, now, EXPIRED_ERROR.to_json()])
        return [_text(x) for x in out]

    def finish(self, finals: Sequence[Final], *, result_ttl_s: int) -> list[bool]:
        """Give each job its terminal status, result and webhook, unless it has one already;
        per job whether this call was the one that finished it."""
        if not finals:
            return []
        keys: list[str] = []
        args: list[Any] = [now_iso(), result_ttl_s]
        for final in finals:
            keys += [job_key(final.job_id), result_key(final.job_id)]
            args += [final.status.value, final.meta,
                     final.error.to_json() if final.error else "",
                     final.webhook.list_key if final.webhook else "",
                     final.webhook.payload if final.webhook else ""]
        return [bool(x) for x in self._scripts["finish"](keys=keys, args=args)]

    def cancel(self, job_id: str) -> str:
        """'ok' (it will never run), 'missing', or the status that keeps it from being
        cancelled."""
        return _text(self._scripts["cancel"](
            keys=[job_key(job_id)],
            args=[now_iso(), CANCELLED_ERROR.to_json(), EXPIRED_ERROR.to_json()]))

    def read(self, job_id: str) -> JobRecord | None:
        """The job, expired first if its deadline has passed while it waited; None when
        there is no record."""
        out = self._scripts["read"](keys=[job_key(job_id), result_key(job_id)],
                                    args=[now_iso(), EXPIRED_ERROR.to_json()])
        if not out:
            return None
        flat, meta = out
        pairs = [_text(x) for x in flat]
        fields = dict(zip(pairs[::2], pairs[1::2]))
        return JobRecord(job_id, fields, orjson.loads(meta) if meta else None)


__all__ = ["CANCELLED_ERROR", "EXPIRED_ERROR", "Final", "IdempotencyMismatch", "JobError",
           "JobRecord", "JobState", "Overloaded", "QueuedMessage", "Status", "StoreFull",
           "Submitted", "TERMINAL", "done_channel", "now_iso"]
