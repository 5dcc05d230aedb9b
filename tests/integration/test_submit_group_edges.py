"""Adversarial groups of submits (session 7's second outside attack on issue 40's submit
script: one EXISTS for a group's records, an owner's jobs list read and pushed once a call, one
HSET table a call, one shared NO_CLAIM key), on a real Redis: a group decides and writes what
the same submits made one at a time decide and write, record for record (DUMP), list for list,
with the same Idempotency-Key twice in a group, a key reused with another body, retries of one
job twice and of a job of the group, owners interleaved, an owner at its quota beside one under
it, a queue filling up mid-group, and a resend of jobs already made beside new ones. The shared
NO_CLAIM key is never written, and one set by hand changes nothing."""
from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime, timezone

import pytest
import redis

from tasks import job_lua
from tasks.jobstate import JobState, new_job
from tasks.keys import PENDING_KEY, job_key
from tasks.messages import QueuedMessage

CREATED = datetime(2026, 12, 6, 7, 0, 0, 123000, tzinfo=timezone.utc)


STALE = [bytes(6) + b"\1" + uuid.UUID(int=10**6 + i, version=4).bytes for i in range(1500)]


class _Held(Exception):
    pass


class _Collect:
    """Stands for the group commit: keeps each submit's (keys, args) and sends none."""

    def __init__(self) -> None:
        self.calls: list = []

    def submit(self, call):
        self.calls.append(call)
        raise _Held


def _job(n: int, owner: str, retry_of: str = ""):
    job = new_job(str(uuid.UUID(int=n * 7919, version=4)), model="m", trace_id="t", inputs=1,
                  priority="normal", owner=owner, token="tok", retry_of=retry_of)
    return dataclasses.replace(job, created_at=CREATED)


def _calls(state: JobState, specs) -> list:
    """Each spec's (keys, args) as JobState.submit builds them."""
    collect = _Collect()
    state._grouped = collect
    try:
        for job, kw in specs:
            kw = dict(kw)
            try:
                state.submit(job, QueuedMessage("q:m", b"payload " + job.id.encode()),
                             depth_lists=["q:m"], max_depth=kw.pop("max_depth", None),
                             ttl_s=600, **kw)
            except _Held:
                pass
    finally:
        state._grouped = None
    return collect.calls


def _groups():
    """Groups of submits, in order; the failed record the retries name is made between the
    first and the second group (`fail`)."""
    n = iter(range(1, 1000))
    a, failed = _job(next(n), "alice"), _job(next(n), "carol")
    first = [(a, {"idempotency": ("idem:alice:k1", "D1")}),
             (_job(next(n), "alice"), {"idempotency": ("idem:alice:k1", "D1")}),
             (_job(next(n), "alice"), {"idempotency": ("idem:alice:k1", "D2")}),
             (_job(next(n), "bob"), {}), (failed, {})]
    mine = _job(next(n), "carol")
    second = [(_job(next(n), "carol", failed.id), {}), (_job(next(n), "carol", failed.id), {}),
              (mine, {}), (_job(next(n), "carol", mine.id), {}),
              (_job(next(n), "carol", str(uuid.UUID(int=5, version=4))), {}),
              (_job(next(n), "alice"), {"idempotency": ("idem:alice:k1", "D1")})]
    third = [(_job(next(n), ("alice", "bob", "dave")[i % 3]),
              {"kept_quota": 300 if i % 3 == 2 else 100_000, "size": 100,
               "request": b"R" * 100 if i % 2 else b"", "max_depth": 17}) for i in range(14)]
    resend = [first[0], (_job(next(n), "zed"), {}), first[3]]
    return [first, second, third, resend], failed


def _state(raw: redis.Redis) -> dict:
    """Every key but the clock's marks: a record by DUMP, a list by its items (an owner's
    entries without their stamps, which must fall newest first), a sorted set by its members,
    a string by its value."""
    out = {}
    for key in sorted(raw.scan_iter("*")):
        kind = raw.type(key)
        if kind == b"hash":
            out[key] = raw.dump(key)
        elif kind == b"list":
            items = raw.lrange(key, 0, -1)
            if key.startswith(b"iq:jobs:"):
                stamps = [int.from_bytes(bytes([i[0] & 127]) + i[1:7], "big") for i in items]
                assert stamps == sorted(stamps, reverse=True) and len(set(stamps)) == len(stamps)
                items = [i[7:] for i in items]
            out[key] = items
        elif kind == b"zset":
            out[key] = raw.zrange(key, 0, -1)
        else:
            out[key] = raw.get(key)
    return out


def _run(state: JobState, raw: redis.Redis, grouped: bool) -> tuple[list, dict]:
    raw.flushdb()
    # An owner's list past the records' time to live: 1,500 entries of long ago, which the
    # owner's submits trim (at most 1,000 a trim; each of these ids asks for one).
    raw.rpush("iq:jobs:alice", *STALE)
    groups, failed = _groups()
    answers = []
    for i, group in enumerate(groups):
        if i == 1:
            raw.hset(job_key(failed.id), "status", "failed")
        calls = _calls(state, group)
        if grouped:
            answers += state._submit_many(calls)
        else:
            answers += [[x.decode() if isinstance(x, bytes) else x
                         for x in state._run("submit", keys, args)] for keys, args in calls]
    return answers, _state(raw)


@pytest.fixture
def clients(redis_server, clean_admin):
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    return JobState(client, keep_s=600, ttl_s=600), redis.Redis.from_url(
        redis_server.extra["admin_url"])


def test_a_group_writes_what_its_submits_made_one_at_a_time_write(clients):
    state, raw = clients
    alone, alone_state = _run(state, raw, grouped=False)
    grouped, grouped_state = _run(state, raw, grouped=True)
    kinds = [kind for kind, _ in grouped]
    # Each edge was met: a resend of a key, a key with another body, a retry made and one
    # refused as retried, one of a job still queued, one of no job, a quota, a full queue.
    assert {"existing", "mismatch", "retried", "not_retryable", "gone", "kept_full",
            "overloaded"} <= set(kinds)
    assert grouped == alone
    assert not set(grouped_state[b"iq:jobs:alice"]) & {entry[7:] for entry in STALE}
    assert grouped_state == alone_state
    assert raw.llen("q:m") == kinds.count("created") - 2  # the resend's two queued once
    assert raw.zcard(PENDING_KEY) == raw.llen("q:m")


def test_the_shared_no_claim_key_is_never_written_and_one_set_by_hand_is_not_read(clients):
    state, raw = clients
    _run(state, raw, grouped=True)
    assert not raw.exists(job_lua.NO_CLAIM)
    assert not list(raw.scan_iter("*no-claim*"))
    # A client sets it by hand to a claim of a job that exists: submits without a key are
    # each made all the same, and the key is left as it was.
    earlier = next(raw.scan_iter("iq:job:*")).decode().split(":", 2)[2]
    raw.set(job_lua.NO_CLAIM, f"{earlier} ")
    jobs = [(_job(900 + i, "ivy"), {}) for i in range(3)]
    answers = state._submit_many(_calls(state, jobs))
    assert answers == [["created", job.id] for job, _ in jobs]
    assert raw.get(job_lua.NO_CLAIM) == f"{earlier} ".encode()
    raw.delete(job_lua.NO_CLAIM)
    raw.rpush(job_lua.NO_CLAIM, "not a string")  # of another type: not read either
    jobs = [(_job(950 + i, "ivy"), {}) for i in range(2)]
    assert state._submit_many(_calls(state, jobs)) == [["created", job.id] for job, _ in jobs]
