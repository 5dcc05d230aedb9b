"""What a job is, as the scripts that move it (tasks/jobstate.py) speak of it: its statuses,
the decisions a start, a delivery claim and a cancel answer, the errors a submit raises, the
terminal outcome a worker reports (`Final`) and the record read back (`JobRecord`; a new one
comes from `new_job`)."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping, Sequence

import orjson

from tasks.errors import ErrorCode, JobError
from tasks.messages import QueuedMessage


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
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _time(text: str | None) -> datetime | None:
    """A record's timestamp: Unix milliseconds (`stamp`), or ISO 8601 as records before
    kept it."""
    if not text:
        return None
    if text.isdigit():
        ms = int(text)
        return datetime.fromtimestamp(ms // 1000, timezone.utc) + timedelta(
            milliseconds=ms % 1000)
    return datetime.fromisoformat(text)


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
        get = record_fields(raw).get
        return cls(
            id=job_id, status=Status(raw["status"]), model=raw["model"],
            created_at=_time(raw["created_at"]),
            trace_id=get("trace_id", ""), inputs=int(get("inputs") or 0),
            priority=get("priority") or "normal", owner=get("owner", ""),
            encoding_format=get("encoding_format") or "float",
            webhook_url=get("webhook_url", ""), webhook_events=get("webhook_events", ""),
            token=get("token", ""),
            expires_at=float(get("expires_at")) if get("expires_at") else None,
            started_at=_time(get("started_at")), finished_at=_time(get("finished_at")),
            worker=get("worker"), batch=_batch(get("batch")),
            runs=int(get("runs") or 0), model_version=get("model_version", ""),
            error=JobError.from_json(raw["error"]) if get("error") else None,
            items_done=int(get("items_done") or 0), retry_of=get("retry_of") or "",
            retried_as=get("retried_as") or "", kept=int(get("kept") or 0), outputs=outputs)


# The fields a succeeded record keeps under short names (tasks/jobscripts.py's COMPACT).
_SHORT = {"t": "trace_id", "w": "worker", "v": "model_version"}


def record_fields(raw: Mapping[str, str]) -> Mapping[str, str]:
    """A record's fields (HGETALL) under their own names, those COMPACT packed (`r`, `t`, `w`,
    `v`) unpacked; a record written with its names (any not final, those of earlier releases)
    as it is."""
    if not any(name in raw for name in ("r", *_SHORT)):
        return raw
    out = {_SHORT.get(name, name): value for name, value in raw.items() if name != "r"}
    if raw.get("r"):
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
