"""The job's status machine (tasks/jobstate.py) on a real Redis, without a worker: each move
is one script, and a terminal status is final."""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace

import orjson
import pytest
import redis

from tasks import results
from tasks.errors import ErrorCode, JobError
from tasks.jobstate import (CancelOutcome, DeliveryClaim, Final, IdempotencyMismatch,
                            JobRecord, JobState, NotReplicated, Overloaded, StartDecision,
                            Status, new_job)
from tasks.keys import PENDING_KEY, job_key, owner_jobs
from tasks.messages import QueuedMessage

RUN, CANCELLED, EXPIRED, FINISHED, MISSING = (
    StartDecision.RUN, StartDecision.CANCELLED, StartDecision.EXPIRED, StartDecision.FINISHED,
    StartDecision.MISSING)


@pytest.fixture
def client(redis_server):
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    return redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)


@pytest.fixture
def state(client):
    return JobState(client)


def job(job_id: str | None = None) -> JobRecord:
    return new_job(job_id or str(uuid.uuid4()), model="m", trace_id="t", inputs=3,
                   priority="high", owner="ops", encoding_format="base64")


def submit(state: JobState, job_id: str | None = None, *, timeout_s: float = 0,
           idempotency: tuple[str, str] | None = None, max_depth: int = 100,
           replicas: tuple[int, float] | None = None):
    record = job(job_id)
    message = QueuedMessage("q", orjson.dumps({"id": record.id}))
    return state.submit(record, message, depth_lists=["q"], max_depth=max_depth, ttl_s=60,
                        timeout_s=timeout_s, idempotency=idempotency, replicas=replicas)


def final(job_id: str, status: Status = Status.SUCCEEDED, marker: str = "a") -> Final:
    error = JobError(ErrorCode.INFERENCE_ERROR, marker) if status is Status.FAILED else None
    stored = results.stored(job_id, error=error) if error else \
        results.stored(job_id, outputs=[marker])
    return Final(job_id, status, stored, error)


def test_submit_records_the_job_and_queues_its_message_together(state, client):
    submitted = job()
    done = state.submit(submitted, QueuedMessage("q", orjson.dumps({"id": submitted.id})),
                        depth_lists=["q"], max_depth=10, ttl_s=60)
    assert done.created and done.job_id == submitted.id
    assert state.read(submitted.id) == submitted  # every field as it was written
    assert state.owner_of(submitted.id) == "ops" and state.owner_of("none") is None
    assert [orjson.loads(m)["id"] for m in client.lrange("q", 0, -1)] == [submitted.id]


def test_a_record_keeps_only_what_differs_from_the_defaults_and_what_a_read_needs(state,
                                                                                  client):
    """Defaults (no owner, float outputs, normal priority) are not written; once it
    succeeded, neither is what only a start needed (its deadline)."""
    plain = new_job(str(uuid.uuid4()), model="m", trace_id="t", inputs=1, priority="normal",
                    token="tok")
    state.submit(plain, QueuedMessage("q", b"{}"), depth_lists=["q"], max_depth=10, ttl_s=60,
                 timeout_s=30)
    assert state.read(plain.id).expires_at is not None
    assert state.read(plain.id) == replace(plain, expires_at=state.read(plain.id).expires_at)
    assert state.owner_of(plain.id) == ""  # a record with no owner field is still found
    assert not {"owner", "encoding_format", "priority"} & set(client.hgetall(job_key(plain.id)))
    assert state.start([plain.id], worker="w/0", batch="b1 1 1", tokens=["tok"]) == [RUN]
    assert state.finish([replace(final(plain.id), token="tok")], result_ttl_s=60,
                        model_version="v1") == [True]
    kept = client.hgetall(job_key(plain.id))
    assert not {"expires_at", "req", "request", "message"} & set(kept)
    assert kept["created_at"] == str(int(plain.created_at.timestamp() * 1000 + 0.5))
    done = state.read(plain.id)
    assert done.inputs == 1 and done.model_version == "v1" and done.runs == 1
    assert done.status is Status.SUCCEEDED and done.created_at == plain.created_at
    assert done.batch == {"id": "b1", "jobs": 1, "items": 1} and done.outputs == ["a"]


def test_a_succeeded_record_is_written_afresh_keeping_every_field_but_the_waiting_ones(
        state, client):
    """FINISH writes a succeeded job's record again, compact (a hash that held its message
    stays in Redis's large encoding otherwise): every field any earlier move wrote is still
    there, but its message, list, deadline and request; and it still expires."""
    retried = submit(state).job_id
    state.cancel(retried)
    record = new_job(str(uuid.uuid4()), model="m", trace_id="t", inputs=3, priority="high",
                     owner="ops", encoding_format="base64", webhook_url="https://h.example/x",
                     webhook_events=("succeeded",), token="tok", retry_of=retried)
    state.submit(record, QueuedMessage("q", b"m" * 2_000), depth_lists=["q"], max_depth=10,
                 ttl_s=60, timeout_s=30, request=b"r" * 500)
    assert state.start([record.id], worker="w/0", batch="b1 1 3", tokens=["tok"]) == [RUN]
    state.progress({record.id: 2})
    state.crashed([record.id])
    before, read_before = client.hgetall(job_key(record.id)), state.read(record.id)
    assert client.object("encoding", job_key(record.id)) == "hashtable"
    assert state.finish([replace(final(record.id), token="tok")], result_ttl_s=60,
                        model_version="v1") == [True]
    after, read_after = client.hgetall(job_key(record.id)), state.read(record.id)
    dropped = {"message", "list", "expires_at", "request"}
    assert dropped <= set(before) and not dropped & set(after)
    # Read back, it is what it was but for what its finish changed.
    assert replace(read_after, status=Status.RUNNING, finished_at=None, model_version="",
                   outputs=None) == replace(read_before, expires_at=None)
    assert read_after.finished_at is not None and read_after.model_version == "v1"
    # Under the names the release before reads a finished record by (its webhook deliverer).
    assert {"status", "model", "created_at", "token", "owner", "priority", "encoding_format",
            "webhook_url", "webhook_events", "retry_of"} <= set(after)
    assert after["status"] == "succeeded" and after["crashes"] == "1"
    assert client.object("encoding", job_key(record.id)) in ("ziplist", "listpack")
    assert 0 < client.ttl(job_key(record.id)) <= 86_400


@pytest.mark.parametrize("claim, max_depth", [(("iq:idem:resent", "digest"), 10), (None, None)])
def test_the_submit_script_sent_again_queues_nothing_more(state, client, claim, max_depth):
    """A resend of the same script (a retry after its answer was lost: a stall, a dropped
    connection) finds the job's id indexed and leaves it one job with one message, with an
    Idempotency-Key or without, its depth checked or not; even once the job has finished
    (its message gone from the pending set), it is not queued again."""
    record = job()
    message = QueuedMessage("q", orjson.dumps({"id": record.id}))
    for _ in range(2):
        done = state.submit(record, message, depth_lists=["q"], max_depth=max_depth,
                            ttl_s=60, idempotency=claim)
        assert done.created and done.job_id == record.id
    assert client.llen("q") == 1 and state.read(record.id) == record
    assert state.finish([final(record.id)], result_ttl_s=60) == [True]
    again = state.submit(record, message, depth_lists=["q"], max_depth=max_depth, ttl_s=60,
                         idempotency=claim)
    assert again.created and client.llen("q") == 1 and client.zcard(PENDING_KEY) == 0
    assert state.read(record.id).status is Status.SUCCEEDED


def test_a_submit_that_no_replica_confirms_is_recorded_and_said_so(state, client):
    """WAIT for a replica this Redis does not have: the job is recorded and queued (it will
    run), and the caller is told that no replica holds it."""
    job_id = str(uuid.uuid4())
    with pytest.raises(NotReplicated) as refused:
        submit(state, job_id, replicas=(1, 0.05))
    assert (refused.value.job_id, refused.value.acked, refused.value.wanted) == (job_id, 0, 1)
    assert state.read(job_id).status is Status.QUEUED and client.llen("q") == 1


def test_a_submit_that_waits_for_replicas_needs_no_cached_script(state, client, redis_server):
    """A promoted replica may not hold the script: the submit that waits for replicas sends
    it whole."""
    redis.Redis.from_url(redis_server.extra["admin_url"]).script_flush()
    done = submit(state, replicas=(0, 0.05))
    assert done.created and state.read(done.job_id) is not None and client.llen("q") == 1


def test_a_full_queue_refuses_without_a_record(state, client):
    for _ in range(2):
        submit(state, max_depth=2)
    refused = str(uuid.uuid4())
    with pytest.raises(Overloaded):
        submit(state, refused, max_depth=2)
    assert state.read(refused) is None and client.llen("q") == 2
    # Nor a record begun (the submit took back the HSETNX that tells a resend) or an entry in
    # its owner's jobs list, so that the same id sent again is judged again, not taken for a
    # resend of a job that was made.
    assert client.exists(job_key(refused)) == 0 and client.llen(owner_jobs("ops")) == 2
    with pytest.raises(Overloaded):
        submit(state, refused, max_depth=2)


def test_concurrent_submits_with_one_idempotency_key_make_one_job(state, client):
    ids: list[str] = []
    created: list[bool] = []
    barrier = threading.Barrier(16)

    def post() -> None:
        barrier.wait()
        done = submit(state, idempotency=("iq:idem:k", "digest-1"))
        ids.append(done.job_id)
        created.append(done.created)

    threads = [threading.Thread(target=post) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == 1 and created.count(True) == 1
    assert client.llen("q") == 1
    with pytest.raises(IdempotencyMismatch):
        submit(state, idempotency=("iq:idem:k", "digest-2"))


def test_start_runs_queued_jobs_and_refuses_the_rest(state):
    queued, cancelled, done = (submit(state).job_id for _ in range(3))
    assert state.cancel(cancelled) is CancelOutcome.CANCELLED
    assert state.start([done], worker="w/0", batch="{}") == [RUN]
    assert state.finish([final(done)], result_ttl_s=60) == [True]
    missing = str(uuid.uuid4())
    decisions = state.start([queued, cancelled, done, missing], worker="w/0", batch="{}")
    assert decisions == [RUN, CANCELLED, FINISHED, MISSING]
    job = state.read(queued)
    assert job.status is Status.RUNNING and job.runs == 1 and job.worker == "w/0"
    assert state.read(done).outputs == ["a"]


def test_a_job_rerun_after_its_child_was_lost_runs_again(state):
    job_id = submit(state).job_id
    assert state.start([job_id], worker="w/0", batch="{}") == [RUN]
    # Its message came back (the child died): running again is allowed, and counted.
    assert state.start([job_id], worker="w/1", batch='{"id": "b"}') == [RUN]
    again = state.read(job_id)
    assert again.runs == 2 and again.worker == "w/1" and again.batch == {"id": "b"}


def test_a_start_sent_again_counts_once(state):
    """A worker's start retried after a timeout (a frozen Redis runs every try once it
    resumes): the same batch on the same worker is one run, not two."""
    job_id = submit(state).job_id
    batch = '{"id": "b1"}'
    assert state.start([job_id], worker="w/0", batch=batch) == [RUN]
    started = state.read(job_id)
    assert state.start([job_id], worker="w/0", batch=batch) == [RUN]
    assert state.read(job_id) == started and started.runs == 1


def test_terminal_states_are_final(state, client):
    job_id = submit(state).job_id
    state.start([job_id], worker="w/0", batch="{}")
    assert state.finish([final(job_id, Status.FAILED, "first")], result_ttl_s=60) == [True]
    before = state.read(job_id)
    # A duplicate run's success, a cancel and a restart change nothing, timestamps included.
    assert state.finish([final(job_id, Status.SUCCEEDED, "second")], result_ttl_s=60) == [False]
    assert state.cancel(job_id) is CancelOutcome.TOO_LATE
    assert state.start([job_id], worker="w/9", batch="{}") == [FINISHED]
    after = state.read(job_id)
    assert after.status is Status.FAILED and after.finished_at is not None
    assert after == before
    assert after.error == JobError(ErrorCode.INFERENCE_ERROR, "first")
    stored = orjson.loads(client.get(f"celery-task-meta-{job_id}"))
    assert stored["result"]["exc_message"] == ["inference_error", "first"]


def test_finish_queues_a_webhook_only_with_the_transition(state, client):
    job_id = submit(state).job_id
    state.start([job_id], worker="w/0", batch="{}")
    hook = QueuedMessage("hooks", b'{"hook": 1}')
    done = Final(job_id, Status.SUCCEEDED, results.stored(job_id, outputs=[]), None, hook)
    assert state.finish([done], result_ttl_s=60) == [True]
    assert state.finish([done], result_ttl_s=60) == [False]
    assert client.llen("hooks") == 1


def test_finish_announces_a_batchs_ids_only_in_one_message(state, client):
    ids = [submit(state).job_id for _ in range(3)]
    pubsub = client.pubsub()
    pubsub.subscribe("iq:moves")
    pubsub.get_message(timeout=1)
    state.start(ids, worker="w/0", batch="{}")
    assert pubsub.get_message(timeout=2)["data"] == "running " + " ".join(ids)
    state.finish([final(ids[0]), final(ids[1], Status.FAILED), final(ids[2])],
                 result_ttl_s=60)
    assert pubsub.get_message(timeout=2)["data"] == "done " + " ".join(ids)
    assert pubsub.get_message(timeout=0.2) is None


def test_expiry_is_decided_by_redis_time_once(state, client):
    job_id = submit(state, timeout_s=30).job_id
    deadline = float(client.hget(f"iq:job:{job_id}", "expires_at"))
    seconds, micros = client.time()
    assert abs(deadline - (seconds + micros / 1e6 + 30)) < 1
    assert state.read(job_id).status is Status.QUEUED
    client.hset(f"iq:job:{job_id}", "expires_at", f"{deadline - 60:.3f}")  # as if 30 s passed
    assert state.read(job_id).status is Status.EXPIRED
    assert state.start([job_id], worker="w/0", batch="{}") == [EXPIRED]
    assert state.cancel(job_id) is CancelOutcome.TOO_LATE


def test_a_read_runs_a_script_only_for_a_queued_job_near_its_deadline(state, client,
                                                                      redis_server):
    """A read is one pipelined HMGET and GET; only a queued job whose deadline is near (on
    this process's clock) or past goes through READ, which decides by Redis's."""
    admin = redis.Redis.from_url(redis_server.extra["admin_url"])

    def scripts_run() -> int:
        return admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)

    far, plain, done = (submit(state, timeout_s=3_600).job_id, submit(state).job_id,
                        submit(state, timeout_s=3_600).job_id)
    state.finish([final(done)], result_ttl_s=60)
    before = scripts_run()
    assert state.read(far).status is Status.QUEUED and state.read(plain).status is Status.QUEUED
    assert state.read(done).outputs == ["a"]
    assert scripts_run() == before
    client.hset(f"iq:job:{far}", "expires_at", f"{time.time() - 1:.3f}")
    assert state.read(far).status is Status.EXPIRED
    after = scripts_run()
    assert after > before  # (twice the first time this Redis runs READ: NOSCRIPT, then it)
    assert state.read(far).status is Status.EXPIRED and scripts_run() == after


def test_a_started_job_does_not_expire(state, client):
    job_id = submit(state, timeout_s=30).job_id
    state.start([job_id], worker="w/0", batch="{}")
    client.hset(f"iq:job:{job_id}", "expires_at", "1")
    assert state.read(job_id).status is Status.RUNNING
    assert state.finish([final(job_id)], result_ttl_s=60) == [True]


def submit_with(state: JobState, **fields) -> JobRecord:
    record = new_job(str(uuid.uuid4()), model="m", trace_id="t", inputs=1, priority="normal",
                     **fields)
    state.submit(record, QueuedMessage("q", b"{}"), depth_lists=["q"], max_depth=100,
                 ttl_s=60)
    return record


def test_only_the_jobs_own_message_starts_or_finishes_it(state):
    """A message sent by hand with a queued job's id (Flower's send-task) carries no token, or
    a wrong one: it neither runs as the job nor finishes it; the job's own message does."""
    record = submit_with(state, token="tok3n")
    assert state.read(record.id).token == "tok3n"
    for forged in ("", "guess"):
        assert state.start([record.id], worker="w/0", batch="{}", tokens=[forged]) == \
            [StartDecision.FOREIGN]
        forged_final = Final(record.id, Status.FAILED, results.stored(record.id, error=JobError(
            ErrorCode.TIMEOUT, "forged")), JobError(ErrorCode.TIMEOUT, "forged"), None, forged)
        assert state.finish([forged_final], result_ttl_s=60) == [False]
    assert state.read(record.id).status is Status.QUEUED and state.read(record.id).runs == 0
    assert state.start([record.id], worker="w/0", batch="{}", tokens=["tok3n"]) == [RUN]
    own = Final(record.id, Status.SUCCEEDED, results.stored(record.id, outputs=["own"]),
                token="tok3n")
    assert state.finish([own], result_ttl_s=60) == [True]
    assert state.read(record.id).outputs == ["own"]
    untokened = submit_with(state)  # a record from before tokens: any message runs it
    assert state.start([untokened.id], worker="w/0", batch="{}") == [RUN]


def finished_with_webhook(state: JobState, events: tuple[str, ...],
                          status: Status = Status.SUCCEEDED) -> str:
    record = submit_with(state, webhook_url="https://example.com/hook", webhook_events=events)
    state.start([record.id], worker="w/0", batch="{}")
    state.finish([final(record.id, status)], result_ttl_s=60)
    return record.id


def test_a_webhook_is_delivered_for_the_jobs_status_if_asked_by_one_delivery(state):
    """A record finished before `finish` recorded its delivery's id: the first id claims it."""
    job_id = finished_with_webhook(state, ("succeeded",))
    claim = state.claim_delivery
    assert claim(job_id, "failed", "msg_forged") is DeliveryClaim.NOT_ITS_STATUS
    assert claim(job_id, "cancelled", "msg_forged") is DeliveryClaim.NOT_ITS_STATUS
    assert claim(job_id, "succeeded", "msg_1") is DeliveryClaim.DELIVER
    assert claim(job_id, "succeeded", "msg_1") is DeliveryClaim.DELIVER  # its retry
    assert claim(job_id, "succeeded", "msg_2") is DeliveryClaim.DUPLICATE  # sent again
    unasked = finished_with_webhook(state, ("succeeded",), Status.FAILED)
    assert claim(unasked, "failed", "msg_3") is DeliveryClaim.NOT_ASKED
    assert claim(str(uuid.uuid4()), "succeeded", "msg_4") is DeliveryClaim.MISSING
    assert claim(submit_with(state).id, "queued", "msg_5") is DeliveryClaim.MISSING  # no hook


def test_only_the_delivery_the_finish_queued_is_sent_and_only_until_it_is_answered(state):
    """The re-attack on issue 26 (F4): a delivery sent through Flower under an id of its
    choosing took a job's webhook over before the real one (which was then dropped), and one
    sent again under the real id was signed and sent again."""
    record = submit_with(state, webhook_url="https://example.com/hook",
                         webhook_events=("succeeded",))
    state.start([record.id], worker="w/0", batch="{}")
    hook = QueuedMessage("hooks", b"{}", "msg_real")
    assert state.finish([replace(final(record.id), webhook=hook)], result_ttl_s=60) == [True]
    claim = state.claim_delivery
    assert claim(record.id, "succeeded", "msg_chosen") is DeliveryClaim.DUPLICATE  # first
    assert claim(record.id, "succeeded", "msg_real") is DeliveryClaim.DELIVER
    assert claim(record.id, "succeeded", "msg_real") is DeliveryClaim.DELIVER  # unanswered yet
    assert not state.delivery_done(record.id, "msg_chosen", "delivered")
    assert state.delivery_done(record.id, "msg_real", "delivered")
    assert claim(record.id, "succeeded", "msg_real") is DeliveryClaim.DONE  # sent again


def test_finish_queued_takes_the_message_off_its_list_and_ends_the_job_in_one_step(state,
                                                                                    client):
    """A reload's failure of a removed model's queued job (scripts/reload_removed.py): the
    message leaves its list and the job ends as a worker's failure ends it (result, dead-letter
    index, webhook); a message a worker took first is left to that worker."""
    taken, left = submit(state).job_id, submit(state).job_id
    messages = {orjson.loads(m)["id"]: m for m in client.lrange("q", 0, -1)}
    hook = QueuedMessage("hooks", b'{"hook": 1}')
    removed = replace(final(taken, Status.FAILED, "removed"), webhook=hook)
    assert state.finish_queued("q", messages[taken], removed, result_ttl_s=60) is True
    assert [orjson.loads(m)["id"] for m in client.lrange("q", 0, -1)] == [left]
    ended = state.read(taken)
    assert ended.status is Status.FAILED and ended.started_at is None
    assert ended.error == JobError(ErrorCode.INFERENCE_ERROR, "removed")
    assert client.zscore("iq:dead:ops", taken) is not None and client.llen("hooks") == 1
    assert client.zscore("iq:pending", taken) is None
    assert state.start([taken], worker="w/0", batch="{}") == [FINISHED]
    # A worker fetched `left` first: nothing changes, its start is the worker's.
    client.lrem("q", 1, messages[left])
    assert state.finish_queued("q", messages[left], final(left, Status.FAILED),
                               result_ttl_s=60) is None
    assert state.read(left).status is Status.QUEUED
    assert state.start([left], worker="w/0", batch="{}") == [RUN]
    # A message still listed whose job ended already leaves the list; the job is unchanged.
    client.lpush("q", messages[taken])
    assert state.finish_queued("q", messages[taken], removed, result_ttl_s=60) is False
    assert client.llen("q") == 0 and state.read(taken) == ended
