"""A job's answer leaves as `job_body` builds it, without a second pass through the `Job`
schema (issue 40: the dump was done twice a job): so `job_body` must be exactly what the
schema dumps, for every shape a job takes, or a field the schema does not document could
leave, or one of another type."""
from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from app.responses import Job, ListedJob, dump, job_body
from tasks.errors import ErrorCode, JobError
from tasks.jobstate import JobRecord, Status

CREATED = datetime(2026, 12, 5, 12, 0, 0, 123000, tzinfo=timezone.utc)
QUEUED = JobRecord(str(uuid.uuid4()), Status.QUEUED, "minilm-embed", CREATED, inputs=2)
RUNNING = replace(QUEUED, status=Status.RUNNING, started_at=CREATED + timedelta(seconds=1),
                  items_done=1, batch={"id": "b1", "jobs": 3, "items": 7}, runs=1,
                  trace_id="t-1", worker="w@h/0/1")
DONE = replace(RUNNING, finished_at=CREATED + timedelta(seconds=2), model_version="v9")
SHAPES = {
    "queued": QUEUED,
    "queued, a retry": replace(QUEUED, retry_of=str(uuid.uuid4()), priority="high",
                               encoding_format="base64", owner="team-a"),
    "running": RUNNING,
    "succeeded": replace(DONE, status=Status.SUCCEEDED, outputs=[[0.5, -1.0], "AAAA", 3]),
    "succeeded, outputs expired": replace(DONE, status=Status.SUCCEEDED, outputs=None),
    "failed, retried": replace(DONE, status=Status.FAILED, retried_as=str(uuid.uuid4()),
                               error=JobError(ErrorCode.INFERENCE_ERROR, "bad input")),
    "cancelled": replace(QUEUED, status=Status.CANCELLED, finished_at=CREATED,
                         error=JobError(ErrorCode.CANCELLED, "cancelled")),
    "expired": replace(QUEUED, status=Status.EXPIRED, finished_at=CREATED,
                       error=JobError(ErrorCode.EXPIRED, "too late")),
}


@pytest.mark.parametrize("peers", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_jobs_body_is_what_the_job_schema_dumps(shape, peers):
    job = SHAPES[shape]
    body = job_body(job, peers=peers)
    # In the schema's order too: the bytes a client sees are those the dump gave.
    assert list_items(dump(Job, body)) == list_items(body)
    listed = job_body(job, outputs=False, peers=peers)
    assert list_items(dump(ListedJob, listed)) == list_items(listed)


def list_items(value):
    """`value` with each mapping as the list of its items, so that key order counts."""
    if isinstance(value, dict):
        return [(key, list_items(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [list_items(item) for item in value]
    return value


def test_a_field_the_schema_lacks_would_be_told_apart():
    # The comparison above sees a field that would leave undocumented.
    body = job_body(SHAPES["running"], peers=True)
    assert dump(Job, {**body, "worker": "w@h/0/1"}) != {**body, "worker": "w@h/0/1"}
