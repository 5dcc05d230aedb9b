"""Jobs as the API sees them: accepted into Redis and onto the model's queue, then read back
from the job record plus Celery's result meta. Never imports torch or a model handler."""
from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable

import orjson
import redis
from celery import Celery

from config import Settings
from config.models import ModelSpec
from app.waiter import ResultWaiter
from tasks.names import PRIORITIES, queue_lists
from tasks.records import (idempotency_key_for, job_key, live_key, live_since, now_iso,
                           result_key)

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired"})


def parse_job_id(raw: str) -> str | None:
    """Canonical job id, or None when `raw` cannot be one we issued (no Redis lookup needed)."""
    try:
        return str(uuid.UUID(raw)) if len(raw) == 36 else None
    except ValueError:
        return None


def _iso(value: Any) -> str | None:
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        return str(value)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def _error_from_meta(result: Any) -> dict[str, str]:
    if isinstance(result, dict):
        exc_type = result.get("exc_type") or "Error"
        args = result.get("exc_message")
        if exc_type == "JobFailed" and isinstance(args, list) and len(args) == 2:
            return {"code": str(args[0]), "message": str(args[1])}
        if exc_type == "TimeLimitExceeded":
            return {"code": "timeout",
                    "message": f"the job ran past its model's time limit ({args} s)"}
        text = " ".join(map(str, args)) if isinstance(args, list) else str(args or "")
        return {"code": "worker_error", "message": f"{exc_type}: {text}".strip()}
    return {"code": "worker_error", "message": str(result)}


@dataclass
class JobView:
    record: dict[str, str]
    meta: dict[str, Any] | None
    job_id: str

    @property
    def status(self) -> str:
        state = (self.meta or {}).get("status")
        if state == "SUCCESS":
            return "succeeded"
        if state == "FAILURE":
            return "failed"
        if state == "REVOKED":
            text = json.dumps((self.meta or {}).get("result"))
            return "expired" if "expired" in text else "cancelled"
        if self.record.get("cancelled_at"):
            return "cancelled"
        if state == "STARTED" or self.record.get("started_at"):
            return "running"
        expires_at = self.record.get("expires_at")
        if expires_at and time.time() > float(expires_at):
            return "expired"  # a worker drops it unrun whenever it reaches one
        return "queued"

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def to_json(self) -> dict[str, Any]:
        status = self.status
        body: dict[str, Any] = {
            "id": self.job_id,
            "model": self.record.get("model"),
            "status": status,
            "created_at": self.record.get("created_at"),
            "started_at": self.record.get("started_at"),
            "finished_at": _iso((self.meta or {}).get("date_done")) if self.terminal else None,
        }
        trace = self.record.get("trace_id")
        if trace:
            body["trace_id"] = trace
        if self.record.get("batch"):
            body["batch"] = json.loads(self.record["batch"])
        result = (self.meta or {}).get("result")
        if status == "succeeded":
            body["result"] = {"outputs": (result or {}).get("outputs", [])}
        elif status == "failed":
            body["error"] = _error_from_meta(result)
        elif status == "cancelled":
            body["error"] = {"code": "cancelled", "message": "the job was cancelled before it ran"}
        elif status == "expired":
            body["error"] = {"code": "expired",
                             "message": "the job was not started before its deadline"}
        return body


# Cancel only what has not started; the worker's start marker refuses a cancelled job.
# Together the two scripts decide atomically which of them wins.
_CANCEL = """
if redis.call('exists', KEYS[1]) == 0 then return 'missing' end
if redis.call('hexists', KEYS[1], 'started_at') == 1 then return 'started' end
if redis.call('hexists', KEYS[1], 'cancelled_at') == 1 then return 'cancelled' end
redis.call('hset', KEYS[1], 'cancelled_at', ARGV[1])
return 'ok'
"""


class Overloaded(Exception):
    """The model's queue is at its configured depth."""


class IdempotencyMismatch(Exception):
    """An Idempotency-Key was reused with a different request body."""


class JobStore:
    def __init__(self, settings: Settings, celery: Celery, models: dict[str, ModelSpec]) -> None:
        self.settings = settings
        self.celery = celery
        self.models = models
        self.redis = redis.Redis.from_url(
            settings.backend,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            health_check_interval=30,
            decode_responses=True,
        )
        self.waiter = ResultWaiter(self.redis)

    @staticmethod
    def _count_queued(pipe: Any, spec: ModelSpec) -> int:
        """Queue on `pipe` the length of each of the model's priority lists; returns how many
        replies that adds (the first ones of the pipeline's, their sum is the depth)."""
        lists = queue_lists(spec.queue)
        for name in lists:
            pipe.llen(name)
        return len(lists)

    def queue_depth(self, spec: ModelSpec) -> int:
        with self.redis.pipeline(transaction=False) as pipe:
            self._count_queued(pipe, spec)
            return int(sum(pipe.execute()))

    def owned_by(self, job_id: str, owner: str) -> bool:
        """Whether `owner` (an API key's name; "" when keys are off) may see the job. A job
        of another key is reported as missing, not forbidden: ids do not leak."""
        return (self.redis.hget(job_key(job_id), "owner") or "") == owner

    def submit(self, spec: ModelSpec, job: dict, trace_id: str,
               idempotency_key: str | None = None,
               owner: str = "") -> tuple[dict[str, Any], bool]:
        """Record and enqueue a job. Returns (record, created); with an Idempotency-Key that
        was seen before, the earlier job's record and False."""
        job_id = str(uuid.uuid4())
        idem = None
        if idempotency_key:
            digest = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()
            idem = idempotency_key_for(f"{owner}:{idempotency_key}")
            if not self.redis.set(idem, f"{job_id} {digest}", nx=True,
                                  ex=self.settings.job_ttl_s):
                earlier = self.redis.get(idem) or ""
                earlier_id, _, earlier_digest = earlier.partition(" ")
                if earlier_digest != digest:
                    raise IdempotencyMismatch(idempotency_key)
                record = self.redis.hgetall(job_key(earlier_id))
                if record:
                    return {"id": earlier_id, **record}, False
                self.redis.set(idem, f"{job_id} {digest}", ex=self.settings.job_ttl_s)
        try:
            record = {"model": spec.name, "created_at": now_iso(), "trace_id": trace_id,
                      "inputs": str(len(job["inputs"])), "priority": job["priority"],
                      "owner": owner}
            timeout_s = job.get("timeout_s") or spec.timeout_s or None
            if timeout_s:
                record["expires_at"] = f"{time.time() + timeout_s:.3f}"
            # The depth check and the record in one round trip; a full queue (the rare case)
            # takes the record back.
            with self.redis.pipeline(transaction=False) as pipe:
                counted = self._count_queued(pipe, spec)
                pipe.hset(job_key(job_id), mapping=record)
                pipe.expire(job_key(job_id), self.settings.job_ttl_s)
                depth = sum(pipe.execute()[:counted])
            if depth >= spec.max_queue_depth:
                self.redis.delete(job_key(job_id))
                raise Overloaded(spec.name)
            try:
                self.celery.send_task(
                    spec.task_name, kwargs={"inputs": job["inputs"], "options": job["options"],
                                            "submitted_at": time.time(),
                                            **({"webhook": job["webhook"]}
                                               if job.get("webhook") else {})},
                    task_id=job_id, headers={"trace_id": trace_id}, expires=timeout_s,
                    priority=PRIORITIES[job["priority"]],
                )
            except Exception:
                # Not on the queue: the record must not promise a job that will never run.
                self.redis.delete(job_key(job_id))
                raise
        except Exception:
            if idem:
                self.redis.delete(idem)
            raise
        return {"id": job_id, **record}, True

    def cancel(self, job_id: str) -> str:
        """'ok' (it will never run), 'missing', or the reason it cannot be: 'started' or
        'cancelled' (already)."""
        outcome = self.redis.eval(_CANCEL, 1, job_key(job_id), now_iso())
        if outcome == "ok":
            # Clients see it at once (and `?wait` wakes); workers drop it unrun.
            self.celery.backend.mark_as_revoked(job_id, "cancelled")
            self.celery.control.revoke(job_id)
        return str(outcome)

    def get(self, job_id: str, owner: str | None = None) -> JobView | None:
        """The job, or None when there is none; with `owner`, also None when it is another
        key's job (as if it did not exist: ids do not leak)."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(job_key(job_id))
            pipe.get(result_key(job_id))
            record, raw_meta = pipe.execute()
        if not record or (owner is not None and record.get("owner", "") != owner):
            return None
        return JobView(record, orjson.loads(raw_meta) if raw_meta else None, job_id)

    def wait(self, job_id: str, timeout_s: float, owner: str) -> JobView | None:
        """The job once it is terminal or `timeout_s` has passed; None at once when there is
        no such job of `owner`'s. Woken by the result backend's own publish on the job's
        channel rather than by polling; the watch starts before the first read, so a result
        stored in between is not missed. Should the listener miss a publish (Redis
        reconnecting), the job is looked at again every second."""
        deadline = time.monotonic() + timeout_s
        with self.waiter.watch(job_id) as finished:
            self.waiter.subscribed.wait(min(timeout_s, self.settings.redis_timeout_s))
            view = self.get(job_id, owner)
            while view is not None and not view.terminal:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                finished.wait(min(remaining, 1.0))
                finished.clear()
                view = self.get(job_id)
        return view

    def live(self, models: Iterable[str]) -> dict[str, dict[str, int]]:
        """Live model instances per model, from the pool children's heartbeats."""
        names = list(models)
        since = live_since(self.settings.heartbeat_ttl_s)
        with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.zrangebyscore(live_key(name), since, "+inf")
            members = pipe.execute()
        out = {}
        for name, found in zip(names, members):
            out[name] = {"workers": len({m.rsplit("/", 1)[0] for m in found}),
                         "instances": len(found)}
        return out

    def queue_depths(self) -> dict[str, int]:
        return {name: self.queue_depth(spec) for name, spec in self.models.items()}

    def ping(self) -> bool:
        return bool(self.redis.ping())
