"""The one owner of a job's state: what a job is (its statuses, its record, `JobRecord`, the
decisions and errors its moves answer with), its record in Redis and its status machine, whose
moves are Lua scripts (tasks/lua/job_*.lua and delivery_*.lua, as tasks/job_lua.py composes
them). The API and the workers both go through here; nothing else writes a job record.

    queued ──▶ running ──▶ succeeded | failed
      │           │
      │           └──▶ running again, only when its message comes back after its pool child
      │                or worker was lost
      └──▶ cancelled | expired

Every move is one Lua script, so each is decided once, inside Redis:

* `submit`: the idempotency claim, the queue-depth and memory checks (when the API asks for
  them: near their limits), the record and the enqueue of the task message are one decision.
  N concurrent submits with one Idempotency-Key give one job, and no record can exist whose
  message was never queued.
* `start`: a batch's jobs become `running` unless they were cancelled, expired or already
  finished (a redelivered message whose result exists is not run again). Expiry is decided by
  Redis's clock, here and in `read`, never by a client's (`read` is a pipelined HMGET and GET
  but for a queued job near its deadline, which it reads through a script).
* `finish`: only a job that is not terminal takes its terminal status; its stored result
  (tasks/results.py) and its webhook delivery are written in the same step, so a duplicate run
  can change nothing and a webhook is queued once. A worker's finish acknowledges the batch's
  messages (off its in-flight hash) in that step too, after every result is stored.
  `finish_queued` does the same for a job whose message still waits on its queue, taking
  the message off in the same step (the queued jobs of a model a reload removed).
* `cancel`: only a queued job is cancelled; `start` refuses a cancelled one.
* `progress`: a running job whose inputs span several model calls counts its items done.
* `claim_delivery`: a webhook delivery is sent only for the job's terminal status, if the job
  asked for that event, only by the delivery `finish` queued (its id is recorded with the
  result), and only until an attempt of it is answered for good (`delivery_done`): a message
  sent by hand (Flower's send-task) cannot make the deliverer sign another event, a delivery
  under another id, or a second copy once the first was answered.

A job's record holds a short random token that its task message carries too (the `job_token`
header): `start` and `finish` move a job only for a message with its token, so that a message
that is not the job's own (sent by hand with its id) can neither run as it nor finish it.

A terminal status is final: no later script changes it or its timestamps. A job read back is a
`JobRecord`; a new one comes from `new_job`.

Beside the record: each owner's index of its jobs, newest first (`list`), and its dead-letter
index of the jobs that did not succeed. A job's request (inputs and options) is kept in its
record while it waits, when it is small enough (`kept_inputs_max_bytes`): a job that succeeds
drops it, one that fails, is cancelled or expires keeps it for `kept_inputs_ttl_s` under a key
of its own, so that it can be retried (`submit` with `retry_of`, which links the two jobs).
Each owner's books count those requests against its quota, and the request's size of a job
that waits with none kept (its message holds the whole input) until it ends.
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping, Sequence

import orjson
import redis
from redis.client import NEVER_DECODE

from tasks import job_lua, results
from tasks.group_commit import GroupCommit
from tasks.errors import ErrorCode, JobError
from tasks.keys import (PENDING_KEY, REMOVED_FAILED_KEY, dead_index, job_key, kept_request,
                        owned_id, owner_index, owner_jobs, result_key, wake_key)
from tasks.messages import QueuedMessage
from tasks.names import PRIORITY_SEP

logger = logging.getLogger(__name__)


class Status(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.EXPIRED})


class StartDecision(enum.Enum):
    """What `start` decided for one job of a batch."""
    RUN = "run"
    MISSING = "missing"  # no record (never submitted, or it ran out)
    FOREIGN = "foreign"  # the message is not the job's own: its token is not the record's
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its deadline passed while it waited (decided now or before)
    FINISHED = "finished"  # it succeeded or failed already: a redelivered message
    LAPSED = "lapsed"  # its message is no longer this worker's (taken back while its lease
    # had lapsed): whoever holds it now runs it


class DeliveryClaim(enum.Enum):
    """What `claim_delivery` decided for one attempt of a webhook delivery."""
    DELIVER = "deliver"
    MISSING = "missing"  # no record (it ran out), or no webhook
    NOT_ITS_STATUS = "not_its_status"  # the event is not the job's terminal status
    NOT_ASKED = "not_asked"  # the job did not ask for this event
    DUPLICATE = "duplicate"  # not the delivery (the id) the job's finish queued
    DONE = "done"  # the job's delivery was answered for good already


class CancelOutcome(enum.Enum):
    CANCELLED = "cancelled"  # it will never run
    MISSING = "missing"
    TOO_LATE = "too_late"  # running or terminal already: its status says which


CANCELLED_ERROR = JobError(ErrorCode.CANCELLED, "the job was cancelled before it ran")
EXPIRED_ERROR = JobError(ErrorCode.EXPIRED, "the job was not started before its deadline")


class Overloaded(Exception):
    """The model's queue is at its configured depth."""


class IdempotencyMismatch(Exception):
    """An Idempotency-Key was reused with a different request body."""


class NotReplicated(Exception):
    """The job is recorded on the primary, but fewer replicas than asked confirmed they hold
    it in time: it will run, unless a failover promotes a replica without it."""

    def __init__(self, job_id: str, acked: int, wanted: int) -> None:
        super().__init__(f"{acked} of {wanted} replica(s) confirmed job {job_id}")
        self.job_id, self.acked, self.wanted = job_id, acked, wanted


class RetryRefused(Exception):
    """A job cannot be retried: `reason` is "missing" (no record), "retried" (it was already,
    as `job_id`) or the status of a job that did not end without success."""

    def __init__(self, reason: str, job_id: str = "") -> None:
        super().__init__(reason)
        self.reason, self.job_id = reason, job_id


class StoreFull(Exception):
    """Redis is within its headroom of maxmemory: new jobs are refused so that the accepted
    ones keep room for their results."""

    def __init__(self, used: int, cap: int) -> None:
        super().__init__(f"Redis holds {used / 2**20:.1f} of its {cap / 2**20:.1f} MiB")
        self.used, self.cap = used, cap


class KeptFull(Exception):
    """The requests Redis keeps for the job's owner would pass its quota (kept_bytes_per_key):
    `held` bytes now, the first of them leaving in `wait_s` seconds."""

    def __init__(self, held: int, quota: int, wait_s: int) -> None:
        super().__init__(f"the requests kept for this owner hold {held} of its {quota} bytes")
        self.held, self.quota, self.wait_s = held, quota, wait_s


@dataclass(frozen=True)
class Final:
    """A job's terminal outcome as a worker reports it to `finish`."""
    job_id: str
    status: Status  # SUCCEEDED or FAILED
    result: bytes  # the stored result (tasks/results.py)
    error: JobError | None = None
    webhook: QueuedMessage | None = None
    token: str = ""  # the token of the message that ran it (its `job_token` header)


def now_stamp() -> str:
    return stamp(datetime.now(timezone.utc))


def stamp(moment: datetime) -> str:
    """A timestamp as records keep it: Unix milliseconds (an integer, which Redis keeps in a
    few bytes: every byte of a record is kept for job_ttl_s)."""
    return str(int(moment.timestamp() * 1000 + 0.5))


def now_iso() -> str:
    return iso(datetime.now(timezone.utc))


def iso(moment: datetime) -> str:
    """A timestamp as the API writes it: UTC, milliseconds, `Z`."""
    text = moment.isoformat(timespec="milliseconds")
    # (UTC's offset, the only place "+00:00" can be, cut by a slice: not a call.)
    return text[:-6] + "Z" if text[-6:] == "+00:00" else text


def _time(text: str | None) -> datetime | None:
    """A record's timestamp: Unix milliseconds (`stamp`), or ISO 8601 as records before
    kept it."""
    if not text:
        return None
    if text.isdigit():  # (from the epoch by one timedelta: two calls, not four)
        return _EPOCH + timedelta(milliseconds=int(text))
    return datetime.fromisoformat(text)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def batch_text(batch: Mapping[str, Any]) -> str:
    """A batch as records keep it (`start`): "<id> <jobs> <items>"."""
    return f"{batch['id']} {batch['jobs']} {batch['items']}"


def _batch(text: str | None) -> dict | None:
    """A record's batch (`batch_text`, or JSON as records before kept it)."""
    if not text:
        return None
    if text.startswith("{"):
        return orjson.loads(text)
    batch_id, jobs, items = text.split()
    return {"id": batch_id, "jobs": int(jobs), "items": int(items)}


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job: its record's fields (`iq:job:<id>`, a hash of these names) and, once it
    succeeded, its outputs while they are kept (`result_ttl_s`)."""
    id: str
    status: Status
    model: str
    created_at: datetime
    trace_id: str = ""
    inputs: int = 0  # how many inputs it has
    priority: str = "normal"
    owner: str = ""  # the API key's name; "" when keys are off
    encoding_format: str = "float"
    webhook_url: str = ""  # where its webhook goes, if it asked for one (tasks/webhooks.py)
    webhook_events: str = ""  # the events it asked for, comma-separated
    token: str = ""  # what its own task message carries (`job_token`); never shown
    expires_at: float | None = None  # its deadline to start, by Redis's clock (seconds)
    started_at: datetime | None = None
    finished_at: datetime | None = None
    worker: str | None = None  # node name / child index / pid of its last run
    batch: dict | None = None  # the batch it last ran in: id, jobs, items
    runs: int = 0
    model_version: str = ""  # the version of the model that gave its terminal status
    error: JobError | None = None
    items_done: int = 0  # of a running job spanning several model calls
    retry_of: str = ""  # the job this one retries
    retried_as: str = ""  # the job that retries this one
    kept: int = 0  # bytes of its request kept for a retry (0: none was)
    outputs: list | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def submitted_fields(self) -> dict[str, str]:
        """The fields `submit` writes (expiry is the script's to set, by Redis's clock).
        A field at its default (`from_fields` reads it back) is not written: every byte of a
        record is kept for job_ttl_s."""
        written = {"status": self.status.value, "model": self.model,
                   "created_at": stamp(self.created_at), "trace_id": self.trace_id,
                   "inputs": str(self.inputs)}
        for name, value, default in (("priority", self.priority, "normal"),
                                     ("owner", self.owner, ""),
                                     ("encoding_format", self.encoding_format, "float")):
            if value != default:
                written[name] = value
        if self.webhook_url:
            written["webhook_url"] = self.webhook_url
            written["webhook_events"] = self.webhook_events
        if self.token:
            written["token"] = self.token
        if self.retry_of:
            written["retry_of"] = self.retry_of
        return written

    @classmethod
    def from_fields(cls, job_id: str, raw: Mapping[str, str],
                    outputs: list | None = None) -> JobRecord:
        # Over the defaults of the fields it may lack ("" or None, as `get` would give), read
        # by subscript: ~20 calls of `get` fewer a record read (issue 40).
        f = {**_ABSENT, **record_fields(raw)}
        return cls(
            id=job_id, status=Status(raw["status"]), model=raw["model"],
            created_at=_time(raw["created_at"]),
            trace_id=f["trace_id"], inputs=int(f["inputs"]) if f["inputs"] else 0,
            priority=f["priority"] or "normal", owner=f["owner"],
            encoding_format=f["encoding_format"] or "float",
            webhook_url=f["webhook_url"], webhook_events=f["webhook_events"],
            token=f["token"], expires_at=float(f["expires_at"]) if f["expires_at"] else None,
            started_at=_time(f["started_at"]) if f["started_at"] else None,
            finished_at=_time(f["finished_at"]) if f["finished_at"] else None,
            worker=f["worker"], batch=_batch(f["batch"]) if f["batch"] else None,
            runs=int(f["runs"]) if f["runs"] else 0, model_version=f["model_version"],
            error=JobError.from_json(raw["error"]) if f["error"] else None,
            items_done=int(f["items_done"]) if f["items_done"] else 0,
            retry_of=f["retry_of"] or "", retried_as=f["retried_as"] or "",
            kept=int(f["kept"]) if f["kept"] else 0, outputs=outputs)


# What `from_fields` reads a field a record lacks as: None for `worker` (a record without one
# never ran), "" for the others.
_ABSENT: dict[str, Any] = {
    **dict.fromkeys(("trace_id", "inputs", "priority", "owner", "encoding_format",
                     "webhook_url", "webhook_events", "token", "expires_at", "started_at",
                     "finished_at", "batch", "runs", "model_version", "error", "items_done",
                     "retry_of", "retried_as", "kept"), ""), "worker": None}


# The fields a succeeded record keeps under short names (tasks/lua/_compact.lua).
_SHORT = {"t": "trace_id", "w": "worker", "v": "model_version"}
_PACKED = frozenset(("r", *_SHORT))  # a record holding none of these was written by its names


def record_fields(raw: Mapping[str, str]) -> Mapping[str, str]:
    """A record's fields (HGETALL) under their own names, those COMPACT packed (`r`, `t`, `w`,
    `v`) unpacked; a record written with its names (any not final, those of earlier releases)
    as it is."""
    if _PACKED.isdisjoint(raw):
        return raw
    out = {(_SHORT[name] if name in _SHORT else name): value for name, value in raw.items()
           if name != "r"}
    if "r" in raw and raw["r"]:
        started, finished, runs, inputs, batch = raw["r"].split(" ", 4)
        start_ms = int(raw["created_at"]) + int(started)
        out.update(started_at=str(start_ms), finished_at=str(start_ms + int(finished)),
                   runs=runs, inputs=inputs, batch=batch)
    return out


def new_job(job_id: str, *, model: str, trace_id: str, inputs: int, priority: str,
            owner: str = "", encoding_format: str = "float", webhook_url: str = "",
            webhook_events: Sequence[str] = (), token: str = "",
            retry_of: str = "") -> JobRecord:
    """A job as it is submitted: `queued`, created now (to the millisecond, as stored)."""
    now = datetime.now(timezone.utc)
    now = now.replace(microsecond=now.microsecond // 1000 * 1000)
    return JobRecord(job_id, Status.QUEUED, model, now, trace_id=trace_id, inputs=inputs,
                     priority=priority, owner=owner, encoding_format=encoding_format,
                     webhook_url=webhook_url, webhook_events=",".join(webhook_events),
                     token=token, retry_of=retry_of)


def _refusal(kind: str, found: str, kept_quota: int | None) -> Exception | None:
    """What the submit script's answer (`kind`, `found`) refuses the job with; None when it
    made the job or found it made."""
    if kind in ("full", "kept_full"):
        first, second = (int(x) for x in found.split())
        return StoreFull(first, second) if kind == "full" else KeptFull(first, kept_quota or 0,
                                                                         second)
    if kind in ("gone", "retried", "not_retryable"):
        return RetryRefused({"gone": "missing", "retried": "retried"}.get(kind, found),
                            found if kind == "retried" else "")
    plain = {"overloaded": Overloaded, "mismatch": IdempotencyMismatch}
    return plain[kind]() if kind in plain else None


# Submits one group commit sends at most (JobState's `group_submits`): a script call's work
# stays bounded (~0.1 ms a job inside Redis).
SUBMIT_GROUP_MOST = 32
# The fields of every record that the submit script names itself (tasks/lua/_submit.lua), their
# values sent alone, in this order: JobRecord.submitted_fields' after `status`.
_SUBMIT_NAMED = ("model", "created_at", "trace_id", "inputs")

# How far this process's clock may be from Redis's for a read to leave a queued job's deadline
# to READ (which expires it by Redis's clock) only when it is this close or past.
CLOCK_MARGIN_S = 30.0


def queue_of(list_key: str) -> str:
    """The queue a Redis list belongs to (its name before the priority step)."""
    return list_key.split(PRIORITY_SEP, 1)[0]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _record(job_id: str, values: Sequence[Any], stored: Any = None) -> JobRecord:
    """A record from READ_FIELDS' values (None or false for a field it lacks)."""
    found = {name: _text(v) for name, v in zip(job_lua.READ_FIELDS, values) if v}
    return JobRecord.from_fields(job_id, found, results.outputs_of(
        stored or None, found.get("encoding_format")))


# A reply channel's entry of a job that succeeded is keyed "2/<n>/<id>" (tasks/lua/_finish.lua):
# its record's n names and values joined by NUL. Another's is keyed by its id alone: its FIELDS
# as a JSON array, as the releases before sent every job (and read only that: an entry keyed
# otherwise is no job they wait on, so they read it when its "done" wakes them).
_JOINED = b"2/"


def announced(message: bytes) -> dict[str, tuple[bytes, bytes, int]]:
    """The jobs of a finish's message on a reply channel (tasks/lua/_finish.lua), each id's
    (fields, stored result, n) as sent: n strings joined by NUL, or a JSON array (n = 0).
    `announced_record` reads one. Cheap, for the listener that receives it; the waiting request
    reads its own."""
    out: dict[str, tuple[bytes, bytes, int]] = {}
    pos, end = 0, len(message)
    while pos < end:
        line = message.index(b"\n", pos)
        key, fields_size, stored_size = message[pos:line].split(b" ")
        start = line + 1
        middle = start + int(fields_size)
        pos = middle + int(stored_size)
        count = 0
        if key.startswith(_JOINED):
            _, joined, key = key.split(b"/", 2)
            count = int(joined)
        out[key.decode()] = (message[start:middle], message[middle:pos], count)
    return out


def announced_record(job_id: str, entry: tuple[bytes, bytes, int]) -> JobRecord | None:
    """The job as its finish announced it (`announced`): what `JobState.read` would have
    read from its record and stored result the moment after. None when the joined fields do
    not split into the n strings sent (a value holding a NUL): its waiter reads it."""
    fields, stored, count = entry
    if not count:
        return _record(job_id, orjson.loads(fields), stored or None)
    # Decoded whole, then split: a NUL is no part of any other character's UTF-8 (one decode,
    # not one a string).
    parts = fields.decode().split("\0")
    if len(parts) != count or count % 2:
        return None
    pairs = iter(parts)
    found = {name: value for name, value in zip(pairs, pairs) if value}
    return JobRecord.from_fields(job_id, found, results.outputs_of(
        stored or None, found["encoding_format"] if "encoding_format" in found else None))


def _finish_call(finals: Sequence[Final], result_ttl_s: int, model_version: str,
                 held: tuple[str, Sequence[str]] | None = None) -> tuple[list[str], list[Any]]:
    """FINISH's keys and arguments (but the two every script takes first); `held`: the
    in-flight hash that holds the jobs' messages and each one's delivery tag, to acknowledge
    them in the same step."""
    keys: list[str] = []
    args: list[Any] = [now_stamp(), result_ttl_s, model_version]
    tags = list(held[1]) if held is not None else [""] * len(finals)
    for final, tag in zip(finals, tags, strict=True):
        keys += [job_key(final.job_id), result_key(final.job_id)]
        hook = final.webhook
        args += [final.status.value, final.result, final.error.to_json() if final.error else "",
                 hook.list_key if hook else "", hook.payload if hook else "",
                 wake_key(queue_of(hook.list_key)) if hook else "", final.token,
                 hook.task_id if hook else "", tag]
    keys.append(PENDING_KEY)
    if held is not None:
        keys.append(held[0])
    return keys, args


@dataclass
class Submitted:
    job_id: str
    created: bool


@dataclass
class Page:
    """Jobs of an index, newest first, their times in it (µs), the next page's start."""
    jobs: list[JobRecord]
    cursor: tuple[str, str] | None
    times: list[int] = field(default_factory=list)


@dataclass
class JobState:
    """The status machine over one Redis client. Each method is one round trip. `keep_s`: how
    long a job that did not succeed keeps its request for a retry (0: none is kept);
    `ttl_s`: how long records live (job_ttl_s), which the indexes follow. `group_submits`:
    submits made within requests while one is on its way to Redis go together in the next
    script call (tasks/group_commit.py; an API process's), but those that wait for replicas;
    `gather_submits`: what lets the requests already runnable reach their submit before a group
    goes (the group commit's `gather`; None: nothing)."""
    client: redis.Redis
    keep_s: int = 0
    ttl_s: int = 86_400
    group_submits: bool = False
    gather_submits: Callable[[], None] | None = None
    _scripts: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _grouped: GroupCommit | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, text in job_lua.SCRIPTS.items():
            self._scripts[name] = self.client.register_script(text)
        if self.group_submits:
            self._grouped = GroupCommit(self._submit_many, most=SUBMIT_GROUP_MOST,
                                        gather=self.gather_submits)

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any],
             ttl_s: int | None = None) -> Any:
        """Run a script with the two arguments every script takes first."""
        return self._scripts[name](keys=keys, args=[self.keep_s, ttl_s or self.ttl_s, *args])

    def _run_undecoded(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """`_run`, its reply as Redis sent it: bytes even where the client decodes replies,
        since a packed result (tasks/results.py) is not text."""
        script = self._scripts[name]
        for attempt in (1, 2):
            try:
                return self.client.execute_command(
                    "EVALSHA", script.sha, len(keys), *keys, self.keep_s, self.ttl_s, *args,
                    **{NEVER_DECODE: True})
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                script.sha = self.client.script_load(script.script)

    def submit(self, job: JobRecord, message: QueuedMessage, *, depth_lists: Sequence[str],
               max_depth: int | None, ttl_s: int, timeout_s: float = 0,
               idempotency: tuple[str, str] | None = None,
               memory_headroom: float | None = None, request: bytes = b"",
               replicas: tuple[int, float] | None = None,
               kept_quota: int | None = None, size: int = 0, reply: str = "") -> Submitted:
        """Record the job, index it under its owner and queue its message, or raise
        Overloaded (`depth_lists` hold `max_depth` messages or more; None: not checked),
        StoreFull (Redis's memory is within `memory_headroom` of its maxmemory; None: not
        checked), IdempotencyMismatch or RetryRefused. With `idempotency` =
        (claim key, request digest) already claimed by an earlier request with the same digest,
        that earlier job's id and created=False. `request`: what to keep for a retry, should it
        not succeed (b"": nothing); with `kept_quota`, the bytes of the requests kept for
        the job's owner may not pass it (KeptFull): a kept request counts its length, a job
        with none its request's `size` while it waits (its message holds the whole input). A job with `retry_of` is made only if that
        job ended without success and was not retried yet; both are then linked. With
        `replicas` = (count, timeout in seconds), also wait (Redis WAIT, in the same round
        trip) until that many replicas hold the job, or raise NotReplicated. `reply`: the
        channel its finish announces it on, record and result (`announced`), for a process
        that waits on it ("": none)."""
        claim, digest = idempotency or (job_lua.NO_CLAIM, "")
        retried = job_key(job.retry_of) if job.retry_of else job_lua.NO_RETRY
        # The script tells a retry by `retried`, and trims its owner's lists by the id.
        args: list[Any] = [job.id, "" if max_depth is None else max_depth, timeout_s or 0,
                           digest, message.payload,
                           "" if memory_headroom is None else memory_headroom, request,
                           "" if kept_quota is None else kept_quota, job.owner, size,
                           owned_id(job.id)]
        fields = job.submitted_fields()
        # Status, the script writes (`queued`), first; the fields every record has
        # by value alone (the script names them), in their order; the others by name and value.
        args += [fields.pop(name) for name in _SUBMIT_NAMED]
        del fields["status"]
        for name, value in fields.items():
            args += [name, value]
        if reply:
            args += ["reply", reply]
        keys = [job_key(job.id), claim, message.list_key, owner_jobs(job.owner), retried,
                PENDING_KEY, wake_key(queue_of(message.list_key)), owner_index(job.owner),
                *(depth_lists if max_depth is not None else ())]
        if replicas is None and self._grouped is not None and (ttl_s or self.ttl_s) == self.ttl_s:
            answer, acked = self._grouped.submit((keys, args)), 0
        elif replicas is None:
            answer, acked = self._run("submit", keys, args, ttl_s), 0
        else:
            answer, acked = self._submit_and_wait(keys, [self.keep_s, ttl_s or self.ttl_s, *args],
                                                 *replicas)
        kind, found = answer  # text from a group's call; as Redis sent it from a lone one
        if type(kind) is not str:
            kind, found = _text(kind), _text(found)
        refused = _refusal(kind, found, kept_quota)
        if refused is not None:
            raise refused
        if replicas is not None and acked < replicas[0]:
            raise NotReplicated(found, acked, replicas[0])
        return Submitted(found, kind == "created")

    def _submit_many(self, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        """Submits that arrived together (`group_submits`), in one script call: each one's
        answer, as the submit script's (the call answers "kind found" a job, one string)."""
        if len(calls) == 1:
            return [self._run("submit", *calls[0])]
        keys: list[str] = []
        args: list[Any] = [bytes(n for job_keys, job_args in calls
                                 for n in (len(job_keys), len(job_args)))]
        for job_keys, job_args in calls:
            keys += job_keys
            args += job_args
        return [_text(answer).split(" ", 1) for answer in self._run("submit_many", keys, args)]

    def _submit_and_wait(self, keys: list[str], args: list[Any], count: int,
                         timeout_s: float) -> tuple[Any, int]:
        """The submit script, then WAIT on the same connection: (its reply, how many
        replicas hold what it wrote). The script goes whole (EVAL), not by hash: a promoted
        replica may not hold it, and a NOSCRIPT would cost a second WAIT."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.eval(job_lua.SUBMIT, len(keys), *keys, *args)
            pipe.execute_command("WAIT", count, max(1, round(timeout_s * 1000)))
            reply, acked = pipe.execute()
        return reply, int(acked)

    def start(self, job_ids: Sequence[str], *, worker: str, batch: str,
              tokens: Sequence[str] = (),
              held: tuple[str, Sequence[str]] | None = None) -> list[StartDecision]:
        """Mark a batch's jobs running; per job, whether to run it or why not. `tokens`: each
        job's token as its message carries it. `held`: the in-flight hash of the worker that
        holds the jobs' messages and each job's delivery tag: a job whose message is no longer
        on it is not started (LAPSED)."""
        now = now_stamp()
        keys = [job_key(j) for j in job_ids]
        tokens = list(tokens) or [""] * len(job_ids)
        tags = list(held[1]) if held is not None else [""] * len(job_ids)
        args = [now, worker, batch, now, EXPIRED_ERROR.to_json()]
        for token, tag in zip(tokens, tags, strict=True):
            args += [token, tag]
        if held is not None:
            keys.append(held[0])
        out = self._run("start", keys, args)
        return [StartDecision(_text(x)) for x in out]

    def progress(self, items_done: Mapping[str, int]) -> int:
        """Count running jobs' items done; how many were running."""
        return int(self._run("progress", [job_key(j) for j in items_done],
                             list(items_done.values())))

    def finish(self, finals: Sequence[Final], *, result_ttl_s: int, model_version: str = "",
               held: tuple[str, Sequence[str]] | None = None) -> list[bool]:
        """Give each job its terminal status, result and webhook, unless it has one already;
        per job whether this call was the one that finished it. `model_version`: the version
        of the model that ran them ("": none ran, as for a batch whose child was lost).
        `held`: the in-flight hash of the worker that holds the jobs' messages and each job's
        delivery tag: every one of those messages is acknowledged in the same step, once every
        job is final (a worker acknowledges a finished batch's messages whatever `finish`
        answered)."""
        if not finals:
            return []
        keys, args = _finish_call(finals, result_ttl_s, model_version, held)
        written = [bool(x) for x in self._run("finish", keys, args)]
        self._count_removed([f for f, fresh in zip(finals, written) if fresh])
        return written

    def finish_queued(self, list_key: str, message: bytes, final: Final, *,
                      result_ttl_s: int) -> bool | None:
        """`finish` for a job whose message waits on queue list `list_key`: the message is
        taken off it and the job finished in one step, so that no worker runs it after. None
        when the message is no longer there (a worker took it: the job is its to settle);
        else whether this call finished the job (False: it had ended already)."""
        keys, args = _finish_call([final], result_ttl_s, "")
        out = self._run("finish_queued", keys, [*args, list_key, message])
        if int(out[0]) > 0:
            self._count_removed([final])
        return None if int(out[0]) < 0 else bool(out[0])

    def _count_removed(self, finished: Sequence[Final]) -> None:
        """Count the jobs just finished `model_removed` (tasks/keys.py REMOVED_FAILED_KEY), for
        a reload to say how many ended so in all, by the workers and by its own sweep. A count
        for people: one Redis refused after the finish leaves it short, which it says."""
        removed = sum(1 for f in finished if f.error and f.error.code == ErrorCode.MODEL_REMOVED)
        if removed:
            try:
                self.client.incrby(REMOVED_FAILED_KEY, removed)
            except redis.RedisError as exc:
                logger.warning("%d job(s) failed model_removed not counted: %s", removed, exc)

    def crashed(self, job_ids: Sequence[str]) -> list[int]:
        """Count a lost pool child against each of these jobs: per job, how many it has lost
        so far (0: no record)."""
        return [int(x) for x in self._run("crashed", [job_key(j) for j in job_ids], [])]

    def claim_delivery(self, job_id: str, event: str, delivery_id: str) -> DeliveryClaim:
        """Whether delivery `delivery_id` may send `event` of the job (its retries may)."""
        return DeliveryClaim(_text(self._run("claim_delivery", [job_key(job_id)],
                                             [event, delivery_id])))

    def delivery_done(self, job_id: str, delivery_id: str, outcome: str) -> bool:
        """The job's delivery got its final answer: no message may deliver it again."""
        return bool(self._run("delivery_done", [job_key(job_id)], [delivery_id, outcome]))

    def cancel(self, job_id: str) -> CancelOutcome:
        return CancelOutcome(_text(self._run(
            "cancel", [job_key(job_id)],
            [now_stamp(), CANCELLED_ERROR.to_json(), EXPIRED_ERROR.to_json()])))

    def read(self, job_id: str) -> JobRecord | None:
        """The job, expired first if its deadline has passed while it waited; None when
        there is no record. One pipelined HMGET and GET (its stored result) read it; only a
        queued job whose deadline is near or past on this process's clock (within
        CLOCK_MARGIN_S) is read again by the READ script, which expires it by Redis's."""
        with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(job_key(job_id), job_lua.READ_FIELDS)
            pipe.execute_command("GET", result_key(job_id), **{NEVER_DECODE: True})
            values, stored = pipe.execute()
        status, expires_at = values[0], values[job_lua.READ_FIELDS.index("expires_at")]
        if status is None:
            return None
        if _text(status) == Status.QUEUED.value and expires_at and \
                float(expires_at) < time.time() + CLOCK_MARGIN_S:
            out = self._run_undecoded("read", [job_key(job_id), result_key(job_id)],
                                      [now_stamp(), EXPIRED_ERROR.to_json()])
            return _record(job_id, *out) if out else None
        return _record(job_id, values, stored if _text(status) == Status.SUCCEEDED.value
                       else None)

    def page(self, owner: str, *, dead: bool = False, status: str = "", model: str = "",
             cursor: tuple[str, str] | None = None, limit: int = 20,
             budget: int = 500) -> Page:
        """A page of the owner's jobs (`dead`: of those that did not succeed), newest first,
        filtered by status and model, reading at most `budget` index entries: a page may
        hold fewer than `limit` jobs and still have a cursor to go on from."""
        indexes = [dead_index(owner)] if dead else [owner_jobs(owner), owner_index(owner)]
        score, after = cursor or ("", "")
        out = self._run("list", indexes, [now_stamp(), EXPIRED_ERROR.to_json(), score, after,
                                          limit, budget, status, model])
        jobs = [_record(_text(job_id), values) for job_id, values, _ in out[2:]]
        return Page(jobs, (_text(out[0]), _text(out[1])) if out[0] else None,
                    [int(us) for _, _, us in out[2:]])

    def delete(self, job_id: str, owner: str) -> str:
        """Delete a finished job of `owner`'s: "deleted", "missing", or the status of a job
        not finished."""
        return _text(self._run("delete", [job_key(job_id), result_key(job_id),
                                          kept_request(job_id)],
                               [owner, now_stamp(), EXPIRED_ERROR.to_json()]))

    def kept_request(self, job_id: str) -> bytes | None:
        """The request kept for a retry of a job that did not succeed, if it still is."""
        return self.client.get(kept_request(job_id))

    def kept(self) -> tuple[int, int]:
        """Requests kept for retries now, and their bytes."""
        jobs, size = self._run("kept", [], [])
        return int(jobs), int(size)

    def token_of(self, job_id: str) -> str | None:
        """The token the job's own task message carries (one field); None when there is no
        record, or it has no token."""
        token = self.client.hget(job_key(job_id), "token")
        return None if token is None else _text(token) or None

    def owner_of(self, job_id: str) -> str | None:
        """The owner of the job's record (one read, no expiry; "" when keys are off); None
        when there is no record."""
        status, owner = self.client.hmget(job_key(job_id), "status", "owner")
        return None if status is None else _text(owner or "")
