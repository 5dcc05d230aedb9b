"""What the job state keeps beside each record (tasks/jobstate.py), on a real Redis without a
worker: each owner's index and its pages, the dead-letter index, the request a job that did
not succeed keeps for a retry (and one that succeeded drops), the retry's link, progress,
deletion."""
from __future__ import annotations

import threading
import uuid

import orjson
import pytest
import redis
from redis.client import NEVER_DECODE

from tasks import results
from tasks.errors import ErrorCode, JobError
from tasks.jobstate import (Final, JobState, RetryRefused, Status, new_job)
from tasks.messages import QueuedMessage

KEEP_S = 60


@pytest.fixture
def client(redis_server):
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    return redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)


@pytest.fixture
def state(client):
    return JobState(client, keep_s=KEEP_S, ttl_s=600)


def submit(state: JobState, *, owner: str = "ops", model: str = "m", request: bytes = b"",
           retry_of: str = "", timeout_s: float = 0) -> str:
    record = new_job(str(uuid.uuid4()), model=model, trace_id="t", inputs=2,
                     priority="normal", owner=owner, retry_of=retry_of)
    state.submit(record, QueuedMessage("q", b"{}"), depth_lists=["q"], max_depth=10_000,
                 ttl_s=600, timeout_s=timeout_s, request=request)
    return record.id


def run(state: JobState, job_id: str, status: Status = Status.SUCCEEDED) -> None:
    state.start([job_id], worker="w/0", batch="{}")
    error = JobError(ErrorCode.INFERENCE_ERROR, "boom") if status is Status.FAILED else None
    stored = results.stored(job_id, error=error) if error else \
        results.stored(job_id, outputs=[[1.0], [2.0]])
    assert state.finish([Final(job_id, status, stored, error)], result_ttl_s=60) == [True]


def ids(page) -> list[str]:
    return [job.id for job in page.jobs]


def test_an_owner_pages_through_its_own_jobs_newest_first(state):
    mine = [submit(state) for _ in range(7)]
    theirs = submit(state, owner="other")
    first = state.page("ops", limit=3)
    assert ids(first) == mine[::-1][:3] and first.cursor is not None
    second = state.page("ops", limit=3, cursor=first.cursor)
    third = state.page("ops", limit=3, cursor=second.cursor)
    assert ids(second) + ids(third) == mine[::-1][3:] and third.cursor is None
    assert ids(state.page("other")) == [theirs]


def owned(us: int, job_id: str) -> bytes:
    """An entry of an owner's jobs list (tasks/lua/_owned.lua): its time in 7 bytes, its id
    in 16."""
    return us.to_bytes(7, "big") + uuid.UUID(job_id).bytes


def listed(client, owner: str = "ops") -> list[tuple[int, str]]:
    """The owner's jobs list, newest first: (time, id) per entry."""
    raw = client.execute_command("LRANGE", f"iq:jobs:{owner}", 0, -1, **{NEVER_DECODE: True})
    return [(int.from_bytes(e[:7], "big"), str(uuid.UUID(bytes=e[7:]))) for e in raw]


def earlier_release_indexed(client, job_id: str, owner: str = "ops") -> None:
    """The job indexed as the release before indexed it (an API process of that release,
    during an upgrade): in the sorted set `iq:owner:<owner>` by its time, not in the list."""
    entry = owned(*next((us, j) for us, j in listed(client, owner) if j == job_id))
    client.lrem(f"iq:jobs:{owner}", 1, entry)
    client.zadd(f"iq:owner:{owner}", {job_id: int.from_bytes(entry[:7], "big")})


def all_pages(state: JobState, limit: int, budget: int = 500) -> list[str]:
    seen, cursor = [], None
    while True:
        page = state.page("ops", limit=limit, cursor=cursor, budget=budget)
        seen += ids(page)
        if page.cursor is None:
            return seen
        cursor = page.cursor


def test_jobs_submitted_at_the_same_moment_are_each_listed_once(state, client):
    made = [submit(state) for _ in range(12)]
    for job_id in made[:6]:
        earlier_release_indexed(client, job_id)
    # One time for all, in both indexes: the cursor's job id tells where a page stopped.
    moment = listed(client)[0][0]
    client.delete("iq:jobs:ops")
    client.lpush("iq:jobs:ops", *(owned(moment, job_id) for job_id in made[6:]))
    client.zadd("iq:owner:ops", {job_id: moment for job_id in made[:6]})
    seen = all_pages(state, 5)
    assert sorted(seen) == sorted(made) and len(seen) == 12


@pytest.mark.parametrize("limit", [1, 2, 5])
def test_pages_that_read_only_their_limit_list_each_job_once_across_ties(state, client, limit):
    """An unfiltered page is given its limit to read (app/store.py's page_reads): a page
    after the first fetches the entries its cursor's time ties with again, to skip them.
    The release before's sorted set may hold ties (its processes stamped alone); this
    release's list never does (each entry after its head's), but may tie with the set."""
    made = [submit(state) for _ in range(12)]
    for job_id in made[:6]:
        earlier_release_indexed(client, job_id)
    moment = listed(client)[0][0]
    client.delete("iq:jobs:ops")
    client.lpush("iq:jobs:ops", *(owned(moment - 3 + i, job_id)
                                  for i, job_id in enumerate(made[6:])))  # one at `moment`
    client.zadd("iq:owner:ops", {job_id: moment for job_id in made[:6]})
    seen = all_pages(state, limit, budget=limit)
    assert sorted(seen) == sorted(made) and len(seen) == 12


@pytest.mark.parametrize("budget", [None, 500])
def test_jobs_the_release_before_indexed_are_listed_among_the_others_by_time(state, client,
                                                                            budget):
    """During an upgrade API processes of both releases submit, each to its own index; a
    listing merges them, newest first, page after page."""
    made = [submit(state) for _ in range(9)]
    for job_id in made[1::3]:
        earlier_release_indexed(client, job_id)
    assert all_pages(state, 2, budget or 2) == made[::-1]
    assert all_pages(state, 1, budget or 1) == made[::-1]
    assert ids(state.page("ops")) == made[::-1]
    assert ids(state.page("ops", limit=4, cursor=state.page("ops", limit=4).cursor)) == \
        made[::-1][4:8]


def test_ids_that_are_not_a_uuids_lowercase_text_are_listed_as_they_are(state, client):
    """The list keeps a UUID's canonical text as its 16 bytes, any other id as its text."""
    made = [submit(state) for _ in range(2)]
    for job_id in ("job-1", str(uuid.uuid4()).upper()):
        record = new_job(job_id, model="m", trace_id="t", inputs=1, priority="normal",
                         owner="ops")
        state.submit(record, QueuedMessage("q", b"{}"), depth_lists=["q"], max_depth=None,
                     ttl_s=600)
        made.append(job_id)
    assert all_pages(state, 3) == made[::-1]


def test_entries_past_the_records_time_to_live_leave_the_owners_jobs_list(state, client):
    old, new = submit(state), submit(state)
    (us_new, _), (us_old, _) = listed(client)
    # As if submitted more than the records' time to live (600 s here) ago.
    client.lset("iq:jobs:ops", 1, owned(us_old - 601 * 10**6, old))
    assert ids(state.page("ops")) == [new] and listed(client) == [(us_new, new)]


def test_a_filtered_page_reads_at_most_its_budget_and_says_where_to_go_on(state):
    wanted = submit(state, model="rare")
    for _ in range(30):
        submit(state, model="common")
    page = state.page("ops", model="rare", limit=5, budget=10)
    assert page.jobs == [] and page.cursor is not None  # 10 read, none matched: go on
    found, cursor = [], page.cursor
    while cursor:
        page = state.page("ops", model="rare", limit=5, budget=10, cursor=cursor)
        found += ids(page)
        cursor = page.cursor
    assert found == [wanted]


def test_the_dead_letter_index_holds_the_jobs_that_did_not_succeed(state):
    ok, failed, cancelled = submit(state), submit(state), submit(state)
    run(state, ok)
    run(state, failed, Status.FAILED)
    state.cancel(cancelled)
    dead = state.page("ops", dead=True)
    assert ids(dead) == [cancelled, failed]  # the last to end first
    assert ids(state.page("ops", dead=True, status="failed")) == [failed]
    assert ids(state.page("ops", status="succeeded")) == [ok]


def end_unsuccessfully(state: JobState, client, failed: str, cancelled: str,
                       expired: str) -> None:
    """Each job ends one way that does not succeed: failed, cancelled, and expired (its
    deadline set in the past, then read)."""
    run(state, failed, Status.FAILED)
    state.cancel(cancelled)
    client.hset(f"iq:job:{expired}", "expires_at", "1")  # its deadline passed
    assert state.read(expired).status is Status.EXPIRED


def assert_kept(state: JobState, client, job_ids, request: bytes, field: str) -> None:
    """Each job's request is kept for a retry in a key of its own, within the keep time, gone
    from the record's `field`, and counted in the books of what is kept."""
    for job_id in job_ids:
        assert state.kept_request(job_id) == request.decode()
        assert 0 < client.ttl(f"iq:request:{job_id}") <= KEEP_S
        assert client.hget(f"iq:job:{job_id}", field) is None
        assert state.read(job_id).kept == len(request)
    assert state.kept() == (len(job_ids), len(job_ids) * len(request))


def test_a_failed_cancelled_or_expired_job_keeps_its_request_and_a_success_drops_it(state,
                                                                                      client):
    request = orjson.dumps({"model": "m", "inputs": ["a", "b"]})
    ok, failed, cancelled = (submit(state, request=request) for _ in range(3))
    expired = submit(state, request=request, timeout_s=30)
    # While it waits, in its record (no key of its own to write, and to delete on success).
    assert client.hget(f"iq:job:{ok}", "request") == request.decode()
    # Not in 'req': the earlier release's workers read that field as the request's size (a
    # request there made their FINISH fail midway, its result unstored).
    assert client.hget(f"iq:job:{ok}", "req") is None
    assert client.exists(f"iq:request:{ok}") == 0
    run(state, ok)
    end_unsuccessfully(state, client, failed, cancelled, expired)
    assert state.kept_request(ok) is None and client.hget(f"iq:job:{ok}", "request") is None
    assert_kept(state, client, (failed, cancelled, expired), request, field="request")


def test_kept_requests_leave_the_books_when_their_time_is_up(state, client):
    request = b'{"inputs": ["x"]}'
    gone, kept = (submit(state, request=request) for _ in range(2))
    for job_id in (gone, kept):
        state.cancel(job_id)
    client.zadd("iq:kept", {f"{gone}:{len(request)}": 1})  # as if its time were up
    assert state.kept() == (1, len(request))


def test_nothing_is_kept_without_a_keep_time(client):
    state = JobState(client, keep_s=0)
    job_id = submit(state, request=b'{"inputs": ["x"]}')
    state.cancel(job_id)
    assert state.kept_request(job_id) is None and state.read(job_id).kept == 0
    assert state.kept() == (0, 0)


def test_a_retry_links_both_jobs_once_and_only_for_a_job_that_did_not_succeed(state):
    failed, ok = submit(state), submit(state)
    run(state, failed, Status.FAILED)
    run(state, ok)
    made: list[str] = []
    refused: list[RetryRefused] = []
    barrier = threading.Barrier(8)

    def retry() -> None:
        barrier.wait()
        try:
            made.append(submit(state, retry_of=failed))
        except RetryRefused as exc:
            refused.append(exc)

    threads = [threading.Thread(target=retry) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(refused) == 7  # concurrent retries make one job
    assert {(r.reason, r.job_id) for r in refused} == {("retried", made[0])}
    assert state.read(failed).retried_as == made[0] and state.read(made[0]).retry_of == failed
    with pytest.raises(RetryRefused) as succeeded:
        submit(state, retry_of=ok)
    assert succeeded.value.reason == "succeeded"
    with pytest.raises(RetryRefused) as missing:
        submit(state, retry_of=str(uuid.uuid4()))
    assert missing.value.reason == "missing"


def test_progress_counts_only_running_jobs(state):
    running, queued = submit(state), submit(state)
    state.start([running], worker="w/0", batch="{}")
    assert state.progress({running: 4, queued: 4}) == 1
    assert state.read(running).items_done == 4 and state.read(queued).items_done == 0


def test_start_and_progress_are_announced_a_batch_at_a_time(state, client):
    jobs = [submit(state) for _ in range(3)]
    pubsub = client.pubsub()
    pubsub.subscribe("iq:moves")
    pubsub.get_message(timeout=1)
    state.start(jobs, worker="w/0", batch="{}")
    state.progress({jobs[0]: 1})
    running, progress = pubsub.get_message(timeout=2), pubsub.get_message(timeout=2)
    assert running["data"] == "running " + " ".join(jobs)
    assert progress["data"] == f"progress {jobs[0]}"


def test_delete_takes_a_finished_job_and_all_it_left(state, client):
    request = b'{"inputs": ["x"]}'
    failed, queued = submit(state, request=request), submit(state)
    run(state, failed, Status.FAILED)
    assert state.delete(queued, "ops") == "queued"  # cancel it first
    assert state.delete(failed, "other") == "missing"  # not theirs
    assert state.delete(failed, "ops") == "deleted"
    assert state.read(failed) is None and state.kept_request(failed) is None
    assert client.get(f"celery-task-meta-{failed}") is None
    assert failed not in ids(state.page("ops")) and ids(state.page("ops", dead=True)) == []
    assert state.kept() == (0, 0)
    assert state.delete(failed, "ops") == "missing"


def test_an_index_entry_whose_record_is_gone_is_not_listed(state, client):
    kept, gone, earlier_gone = submit(state), submit(state), submit(state)
    earlier_release_indexed(client, earlier_gone)
    for job_id in (gone, earlier_gone):
        client.delete(f"iq:job:{job_id}")  # its record expired
    assert ids(state.page("ops")) == [kept]
    # It leaves the sorted set; the list drops it with the entries of its time.
    assert client.zcard("iq:owner:ops") == 0 and len(listed(client)) == 2


def earlier_release_submit(state: JobState, client, request: bytes) -> str:
    """A job queued by the release before the request moved into the record (552d671), as
    its submit wrote it: the record's `req` held the request's size, the request a key of its
    own (`iq:request:<id>`, job_ttl_s). Redis keeps such jobs across a restart onto this
    release (`make run` stopped and started again on its append-only file)."""
    job_id = submit(state)
    client.hset(f"iq:job:{job_id}", "req", len(request))
    client.set(f"iq:request:{job_id}", request, ex=600)
    return job_id


def test_a_job_queued_by_the_earlier_release_keeps_its_request_when_it_does_not_succeed(
        state, client):
    # The request must survive the job's end as the request, not as its size: a retry reads
    # it back as the job to submit again.
    request = orjson.dumps({"model": "m", "inputs": ["a", "b"]})
    ok, failed, cancelled, expired = (earlier_release_submit(state, client, request)
                                      for _ in range(4))
    run(state, ok)  # a success drops it, as that release's did
    assert client.exists(f"iq:request:{ok}") == 0 and "req" not in client.hgetall(f"iq:job:{ok}")
    end_unsuccessfully(state, client, failed, cancelled, expired)
    assert_kept(state, client, (failed, cancelled, expired), request, field="req")


def test_a_clock_that_steps_back_leaves_the_owners_jobs_list_in_order(state, client):
    """Redis's clock steps back (an NTP step, a failover to a replica a little behind): jobs
    submitted after it are stamped after the list's head, not below it, so that paging (its
    bisection to the cursor) passes over none of them."""
    made = [submit(state) for _ in range(20)]
    now = listed(client)[0][0]
    # As if the clock stepped back to just after the third job: the 17 after it are ahead.
    times = {job_id: now - 2_500_000 + 1_000_000 * i for i, job_id in enumerate(made)}
    client.delete("iq:jobs:ops")
    client.lpush("iq:jobs:ops", *(owned(times[job_id], job_id) for job_id in made))
    late = [submit(state) for _ in range(3)]
    entries = listed(client)
    assert [us for us, _ in entries] == sorted((us for us, _ in entries), reverse=True)
    assert all_pages(state, 2) == (made + late)[::-1]
