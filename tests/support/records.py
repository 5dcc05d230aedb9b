"""A job's record as the tests read it from Redis: under its fields' own names, a succeeded
record's packed fields unpacked (tasks/jobstate.py's record_fields)."""
from __future__ import annotations

import redis

from tasks.jobstate import record_fields
from tasks.keys import job_key


def fields(client: redis.Redis, job_id: str) -> dict[str, str]:
    """The job's record (a client that decodes responses), {} when there is none."""
    return dict(record_fields(client.hgetall(job_key(job_id))))


def fields_of(client: redis.Redis, job_ids: list[str]) -> dict[str, dict[str, str]]:
    """fields() of each job, in one round trip."""
    with client.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hgetall(job_key(job_id))
        return {job_id: dict(record_fields(raw)) for job_id, raw in zip(job_ids, pipe.execute())}
