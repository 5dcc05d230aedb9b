"""Jobs as the API sees them: accepted into Redis and onto the model's queue, then read back
from the job record plus Celery's result meta. Never imports torch or a model handler."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable

import redis
from celery import Celery

from config import Settings
from config.models import ModelSpec
from tasks.records import job_key, live_key, live_since, now_iso, result_key

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
        if state == "STARTED" or self.record.get("started_at"):
            return "running"
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
        elif status in ("cancelled", "expired"):
            body["error"] = {"code": status, "message": f"the job was {status} before it ran"}
        return body


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

    def submit(self, spec: ModelSpec, job: dict, trace_id: str) -> dict[str, Any]:
        job_id = str(uuid.uuid4())
        record = {"model": spec.name, "created_at": now_iso(), "trace_id": trace_id,
                  "inputs": str(len(job["inputs"]))}
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(job_key(job_id), mapping=record)
            pipe.expire(job_key(job_id), self.settings.job_ttl_s)
            pipe.execute()
        try:
            self.celery.send_task(
                spec.task_name, kwargs={"inputs": job["inputs"], "options": job["options"]},
                task_id=job_id, headers={"trace_id": trace_id},
            )
        except Exception:
            # Not on the queue: the record must not promise a job that will never run.
            self.redis.delete(job_key(job_id))
            raise
        return {"id": job_id, **record}

    def get(self, job_id: str) -> JobView | None:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(job_key(job_id))
            pipe.get(result_key(job_id))
            record, raw_meta = pipe.execute()
        if not record:
            return None
        return JobView(record, json.loads(raw_meta) if raw_meta else None, job_id)

    def wait(self, job_id: str, timeout_s: float) -> JobView | None:
        """Until the job is terminal or `timeout_s` passes, woken by the result backend's own
        publish on the job's channel rather than by polling."""
        view = self.get(job_id)
        if view is None or view.terminal:
            return view
        deadline = time.monotonic() + timeout_s
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(result_key(job_id))
            view = self.get(job_id)  # it may have finished before the subscription began
            while view is not None and not view.terminal:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if pubsub.get_message(timeout=min(remaining, 1.0)) is not None:
                    view = self.get(job_id)
        finally:
            pubsub.close()
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
        with self.redis.pipeline(transaction=False) as pipe:
            for spec in self.models.values():
                pipe.llen(spec.queue)
            depths = pipe.execute()
        return {name: int(d) for name, d in zip(self.models, depths)}

    def ping(self) -> bool:
        return bool(self.redis.ping())
