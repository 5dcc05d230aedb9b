"""Each API key's quota on the bytes of the requests Redis keeps for it (kept_bytes_per_key), on
a real Redis without a worker: the submit script charges a kept request to its owner's books
and refuses one past the quota; every move that drops a request (a success, a delete, a kept
key's or a record's time running out, a retry window of 0) takes it off them, once, so that the
books never drift from what Redis holds."""
from __future__ import annotations

import time
import uuid

import orjson
import pytest
import redis

from tasks import results
from tasks.jobstate import (CancelOutcome, Final, JobRecord, JobState, KeptFull, StartDecision,
                            Status, new_job)
from tasks.keys import KEPT_BY_BYTES_PREFIX, KEPT_BY_PREFIX, kept_request
from tasks.messages import QueuedMessage

REQUEST = b"x" * 1000
QUOTA = 3500  # three requests fit, a fourth does not
RUN = StartDecision.RUN


@pytest.fixture
def client(redis_server):
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    return redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)


def job(owner: str = "alice") -> JobRecord:
    return new_job(str(uuid.uuid4()), model="m", trace_id="t", inputs=1, priority="normal",
                   owner=owner)


def submit(state: JobState, owner: str = "alice", *, timeout_s: float = 0,
           request: bytes = REQUEST, ttl_s: int = 60, quota: int | None = QUOTA,
           size: int = 0) -> str:
    record = job(owner)
    message = QueuedMessage("q", orjson.dumps({"id": record.id}))
    return state.submit(record, message, depth_lists=["q"], max_depth=None, ttl_s=ttl_s,
                        timeout_s=timeout_s, request=request, kept_quota=quota,
                        size=size).job_id


def books(client, owner: str = "alice") -> tuple[int, int]:
    """(the requests on the owner's books, the bytes its total says)."""
    return (client.zcard(KEPT_BY_PREFIX + owner),
            int(client.get(KEPT_BY_BYTES_PREFIX + owner) or 0))


def succeeded(job_id: str) -> Final:
    return Final(job_id, Status.SUCCEEDED, results.stored(job_id, outputs=["a"]), None)


def test_a_key_past_its_quota_is_refused_and_another_key_is_not(client):
    state = JobState(client, keep_s=600, ttl_s=60)
    for _ in range(3):
        submit(state)
    assert books(client) == (3, 3000)
    with pytest.raises(KeptFull) as refused:
        submit(state)
    assert refused.value.held == 3000 and refused.value.quota == QUOTA
    assert 0 < refused.value.wait_s <= 60  # the first leaves with its record, at the latest
    assert books(client) == (3, 3000)  # the refused one took nothing
    assert client.llen("q") == 3
    submit(state, "bob")  # another key's books are its own
    assert books(client, "bob") == (1, 1000)
    submit(state, quota=None)  # no quota: nothing checked, nothing charged
    assert books(client) == (3, 3000)


def test_every_move_that_drops_a_request_takes_it_off_the_books_once(client):
    state = JobState(client, keep_s=600, ttl_s=60)
    ok, expired, cancelled = submit(state), submit(state, timeout_s=0.001), submit(state)
    assert books(client) == (3, 3000)
    state.finish([succeeded(ok)], result_ttl_s=60)  # a success drops its request
    assert books(client) == (2, 2000)
    time.sleep(0.01)  # past its deadline (Redis's clock decides: checked below)
    assert state.read(expired).status is Status.EXPIRED  # kept for a retry: still charged
    assert state.cancel(cancelled) is CancelOutcome.CANCELLED
    assert books(client) == (2, 2000)
    assert client.get(kept_request(expired)) is not None
    # Charged now until its kept key's end, no longer until its record's.
    score = client.zscore(KEPT_BY_PREFIX + "alice", f"{expired}:1000")
    assert abs(score - (time.time() + 600)) < 30
    assert state.delete(expired, "alice") == "deleted"
    assert books(client) == (1, 1000)
    assert state.delete(expired, "alice") == "missing"  # once only
    state.finish([succeeded(cancelled)], result_ttl_s=60)  # already final: drops nothing
    assert books(client) == (1, 1000)


def test_without_a_retry_window_an_ended_job_leaves_the_books(client):
    state = JobState(client, keep_s=0, ttl_s=60)
    failed, cancelled = submit(state), submit(state)
    state.finish([Final(failed, Status.FAILED, results.stored(failed, outputs=["a"]), None)],
                 result_ttl_s=60)
    state.cancel(cancelled)
    assert books(client) == (0, 0)


def test_requests_whose_time_is_up_leave_the_books_on_the_next_submit(client):
    """A kept key or a record that runs out is not told to anyone: its member's time in the
    books is when it leaves Redis, and the next submit of its owner drops it."""
    state = JobState(client, keep_s=1, ttl_s=60)
    quick = JobState(client, keep_s=1, ttl_s=1)
    gone_record = submit(quick, ttl_s=1)  # waits no longer than its record lives
    ended = submit(state)
    state.cancel(ended)  # its request kept 1 s
    submit(state)
    assert books(client) == (3, 3000)
    with pytest.raises(KeptFull):
        submit(state, request=b"y" * 600)
    time.sleep(1.1)  # past both, by Redis's clock too (its TIME is within microseconds)
    assert client.get(kept_request(ended)) is None and not client.exists(f"iq:job:{gone_record}")
    submit(state, request=b"y" * 600)
    assert books(client) == (2, 1600)


def test_a_waiting_job_whose_request_is_not_kept_is_charged_its_size_until_it_ends(client):
    """A request too large to keep for a retry (or with retries off) is not kept, but while
    its job waits its message and record hold the whole input: its size counts against the
    quota like a kept one, and leaves the books when the job ends, whatever way it ends."""
    state = JobState(client, keep_s=600, ttl_s=60)
    large = dict(request=b"", size=1000)  # over kept_inputs_max_bytes: nothing kept
    ok, failed, cancelled = submit(state, **large), submit(state, **large), submit(state, **large)
    assert books(client) == (3, 3000)
    with pytest.raises(KeptFull) as refused:
        submit(state, **large)
    assert refused.value.held == 3000
    assert client.llen("q") == 3
    assert state.start([ok, failed], worker="w/0", batch="b 1 2") == [RUN, RUN]
    assert books(client) == (3, 3000)  # running: its message is still held
    state.finish([succeeded(ok), Final(failed, Status.FAILED,
                                       results.stored(failed, outputs=["a"]), None)],
                 result_ttl_s=60)
    assert books(client) == (1, 1000)  # neither is kept for a retry
    assert client.get(kept_request(failed)) is None
    assert state.cancel(cancelled) is CancelOutcome.CANCELLED
    assert books(client) == (0, 0)
    expired = submit(state, timeout_s=0.001, **large)
    assert books(client) == (1, 1000)
    time.sleep(0.01)
    assert state.read(expired).status is Status.EXPIRED
    assert books(client) == (0, 0)
    assert state.delete(expired, "alice") == "deleted"  # released once only
    assert books(client) == (0, 0)
    # Retries off: the same, and a job that waits is charged whatever is kept.
    off = JobState(client, keep_s=0, ttl_s=60)
    gone = submit(off, **large)
    assert books(client) == (1, 1000)
    off.finish([Final(gone, Status.FAILED, results.stored(gone, outputs=["a"]), None)],
               result_ttl_s=60)
    assert books(client) == (0, 0)


def test_a_resent_submit_is_not_charged_twice(client):
    state = JobState(client, keep_s=600, ttl_s=60)
    record = job()
    message = QueuedMessage("q", orjson.dumps({"id": record.id}))
    for _ in range(2):
        state.submit(record, message, depth_lists=["q"], max_depth=None, ttl_s=60,
                     request=REQUEST, kept_quota=QUOTA)
    assert books(client) == (1, 1000)
