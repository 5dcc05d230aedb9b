"""Submits that arrive together in one API process go to Redis as one script call (issue 40's
group commit: tasks/group_commit.py, tasks/lua/job_submit_many.lua), on a real Redis, each job
decided as a submit of its own would be: recorded and queued, a resend of an Idempotency-Key
given the earlier job, a key reused with another body refused, a full queue refused."""
from __future__ import annotations

import secrets
import threading
import uuid

import pytest
import redis

from scripts.processes import wait_until
from tasks import redis_deadline
from tasks.jobstate import IdempotencyMismatch, JobState, Overloaded, Status, new_job
from tasks.keys import job_key
from tasks.messages import QueuedMessage


@pytest.fixture
def state(redis_server, clean_admin):
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    state = JobState(client, keep_s=600, ttl_s=600, group_submits=True)
    for name in ("submit", "submit_many"):  # loaded: no NOSCRIPT to count
        client.script_load(state._scripts[name].script)
    return state


def _submit(state: JobState, out: dict, name: str, *, queue: str = "embed",
            claim: tuple[str, str] | None = None, max_depth: int | None = None) -> None:
    record = new_job(str(uuid.uuid4()), model="embed", trace_id=name, inputs=1,
                     priority="normal", token=secrets.token_urlsafe(6))
    with redis_deadline.deadline(20):
        try:
            out[name] = (record.id, state.submit(
                record, QueuedMessage(queue, f"message {name}".encode()),
                depth_lists=[queue], max_depth=max_depth, ttl_s=600, idempotency=claim))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[name] = (record.id, exc)


def test_submits_queued_behind_one_go_in_one_script_call_each_decided_as_its_own(
        state, clean_admin):
    out: dict = {}
    clean_admin.lpush("full", "a", "b")  # a queue at its depth of 2
    # Redis holds every write for a while: the first submit waits in it, the others queue
    # behind it in this process and go together once it is answered.
    clean_admin.execute_command("CLIENT", "PAUSE", 20000, "WRITE")
    try:
        first = threading.Thread(target=_submit, args=(state, out, "first"))
        first.start()
        wait_until(lambda: state._grouped._busy, 10, "the first submit on its way")
        calls = {"plain": {}, "same-1": {"claim": ("iq:idem:k", "d1")},
                 "same-2": {"claim": ("iq:idem:k", "d1")},
                 "other-body": {"claim": ("iq:idem:k", "d2")},
                 "full": {"queue": "full", "max_depth": 2}}
        threads = []
        for name, options in calls.items():
            threads.append(threading.Thread(target=_submit, args=(state, out, name),
                                            kwargs=options))
            threads[-1].start()
            # One after another, so that the group holds them in this order.
            wait_until(lambda n=len(threads): len(state._grouped._queued) == n, 10,
                       f"{name} queued")
        before = clean_admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    finally:
        clean_admin.execute_command("CLIENT", "UNPAUSE")
    for thread in [first, *threads]:
        thread.join(20)
    after = clean_admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert state._grouped.calls == 2 and state._grouped.items == 6
    assert after - before == 2  # the first's and the group's

    for name in ("first", "plain", "same-1"):
        job_id, submitted = out[name]
        assert submitted.created and submitted.job_id == job_id
        assert clean_admin.hget(job_key(job_id), "status") == Status.QUEUED.value
    assert out["same-2"][1].job_id == out["same-1"][0] and not out["same-2"][1].created
    assert isinstance(out["other-body"][1], IdempotencyMismatch)
    assert isinstance(out["full"][1], Overloaded)
    for name in ("same-2", "other-body", "full"):  # refused or a resend: no record of its own
        assert not clean_admin.exists(job_key(out[name][0]))
    assert clean_admin.llen("embed") == 3  # first, plain, same-1: each message queued once
