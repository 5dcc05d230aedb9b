"""Redis keys both sides use besides Celery's own: the job record and worker liveness.

The job record is written by the API when a job is accepted (so an id that was never issued
is a 404, not Celery's PENDING) and completed by the pool child that starts the job. Status
itself comes from Celery's result meta; the record holds what Celery does not.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

KEY_PREFIX = "iq:"


def job_key(job_id: str) -> str:
    return f"{KEY_PREFIX}job:{job_id}"


def idempotency_key_for(key: str) -> str:
    return f"{KEY_PREFIX}idem:{key}"


def live_key(model: str) -> str:
    """Sorted set of live model instances (`hostname/index`), scored by last heartbeat."""
    return f"{KEY_PREFIX}live:{model}"


def result_key(job_id: str) -> str:
    """Celery's Redis result backend key (and pub/sub channel) for a task id."""
    return f"celery-task-meta-{job_id}"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def live_since(ttl_s: float) -> float:
    return time.time() - ttl_s
