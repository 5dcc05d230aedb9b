"""A job submitted with a reply channel (`Prefer: wait`) is announced there by its finish, record
and result, so that the API process waiting on it answers without reading it (issue 40): on a
real Redis, through JobState's scripts as the API and a worker run them, and the API process's
result listener (app/waiter.py)."""
from __future__ import annotations

import json
import secrets
import uuid

import numpy as np
import pytest
import redis

from app.waiter import ResultWaiter
from tasks import job_lua, results
from tasks.errors import ErrorCode, JobError
from tasks.jobstate import (Final, JobState, StartDecision, Status, announced, announced_record,
                           batch_text, new_job)
from tasks.keys import job_key, result_key
from tasks.messages import QueuedMessage


@pytest.fixture
def clients(redis_server):
    url = redis_server.extra["url"]
    text = redis.Redis.from_url(url, decode_responses=True)
    waiter = ResultWaiter(redis.Redis.from_url(url), max_waits=10, max_per_key=10)
    yield JobState(text, keep_s=600, ttl_s=600), waiter, text
    waiter.close()


def _run(state: JobState, reply: str, final: str = "succeeded", job_id: str = "",
         values: int = 4) -> str:
    """A one-input job submitted (naming `reply`), started and finished as a worker does."""
    token = secrets.token_urlsafe(6)
    record = new_job(job_id or str(uuid.uuid4()), model="embed",
                     trace_id=secrets.token_hex(16), inputs=1, priority="normal", token=token)
    state.submit(record, QueuedMessage("embed", b"m" * 100), depth_lists=["embed"],
                 max_depth=None, ttl_s=600, request=b'{"inputs": ["x"]}', reply=reply)
    batch = batch_text({"id": uuid.uuid4().hex[:12], "jobs": 1, "items": 1})
    assert state.start([record.id], worker="w@h/0/1", batch=batch,
                       tokens=[token]) == [StartDecision.RUN]
    if final == "succeeded":
        outputs = [np.arange(values, dtype=np.float32).tolist()]
        done = Final(record.id, Status.SUCCEEDED, results.stored(record.id, outputs=outputs),
                     token=token)
    else:
        error = JobError(ErrorCode.INFERENCE_ERROR, "bad input")
        done = Final(record.id, Status.FAILED, results.stored(record.id, error=error),
                     error=error, token=token)
    assert state.finish([done], result_ttl_s=600, model_version="v1") == [True]
    return record.id


@pytest.mark.parametrize("final", ["succeeded", "failed"])
def test_the_finish_brings_the_job_to_its_waiting_process_as_a_read_finds_it(clients, final):
    state, waiter, text = clients
    assert waiter.reply_channel
    job_id = str(uuid.uuid4())
    with waiter.watch(job_id) as woken:  # before the submit, as `Prefer: wait` watches
        assert waiter.subscribed.wait(5)
        woken.clear()  # the wake-up every waiter gets once subscribed
        _run(state, waiter.reply_channel, final, job_id)
        assert woken.wait(5)  # by the "done" that follows the reply
        answered = waiter.answer(job_id)
    assert answered is not None and answered == state.read(job_id)
    assert answered.status.value == final and answered.model_version == "v1"
    if final == "succeeded":
        assert answered.outputs == [[0.0, 1.0, 2.0, 3.0]]
    else:
        assert answered.error.code == ErrorCode.INFERENCE_ERROR
    assert not text.hexists(job_key(job_id), "reply")  # the finished record drops it
    assert waiter.answer(job_id) is None and not waiter._answers  # taken once, not kept


def test_a_job_no_one_watches_is_not_kept(clients):
    state, waiter, _ = clients
    with waiter.watch("someone-else") as woken:
        assert waiter.subscribed.wait(5)
        woken.clear()
        job_id = _run(state, waiter.reply_channel)
        # Its "done" follows the reply on the listener's one connection: once a "done" for a
        # watched job arrives after it, the reply has been handled.
        state.client.publish("iq:moves", "done someone-else")
        assert woken.wait(5)
    assert waiter.answer(job_id) is None and not waiter._answers


def test_a_job_without_a_reply_channel_is_announced_on_the_moves_channel_only(clients):
    state, waiter, text = clients
    pubsub = text.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe("iq:*")
    pubsub.get_message(timeout=1)  # its subscription confirmed
    job_id = _run(state, "")
    seen = []
    while (message := pubsub.get_message(timeout=1)) is not None:
        seen.append(message["channel"])
    pubsub.close()
    assert "iq:moves" in seen and not [c for c in seen if c.startswith("iq:reply:")]
    assert state.read(job_id).status is Status.SUCCEEDED


def test_a_result_too_large_for_the_reply_channel_is_read_by_its_waiter(clients):
    state, waiter, _ = clients
    job_id = str(uuid.uuid4())
    with waiter.watch(job_id) as woken:
        assert waiter.subscribed.wait(5)
        woken.clear()
        _run(state, waiter.reply_channel, job_id=job_id, values=20_000)  # 80 kB > 64 KiB
        assert woken.wait(5)  # by its "done"
        assert waiter.answer(job_id) is None  # not sent: the waiter reads it
    assert len(state.read(job_id).outputs[0]) == 20_000


def _binary(text: redis.Redis) -> redis.Redis:
    return redis.Redis(connection_pool=redis.ConnectionPool(
        **{**text.connection_pool.connection_kwargs, "decode_responses": False}))


def _sent(text: redis.Redis, run) -> bytes:
    """The one message a finish sends on a reply channel of its own (`run(channel)` runs it)."""
    binary = _binary(text)
    channel = "iq:reply:" + secrets.token_hex(8)
    pubsub = binary.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel)
    pubsub.get_message(timeout=1)  # its subscription confirmed
    run(channel)
    message = pubsub.get_message(timeout=5)
    pubsub.close()
    assert message is not None
    return message["data"]


def _before(message: bytes) -> dict[str, tuple[bytes, bytes]]:
    """The release before's parser (tasks/jobstate.py `announced` at 25262b3), verbatim: what an
    API process of that release makes of a message during a rolling upgrade."""
    out: dict[str, tuple[bytes, bytes]] = {}
    pos, end = 0, len(message)
    while pos < end:
        line = message.index(b"\n", pos)
        job_id, fields_size, stored_size = message[pos:line].split(b" ")
        start = line + 1
        middle = start + int(fields_size)
        pos = middle + int(stored_size)
        out[job_id.decode()] = (message[start:middle], message[middle:pos])
    return out


def test_a_success_is_announced_as_the_record_it_wrote_joined_not_as_json(clients):
    """Its entry is the record's names and values as HGETALL finds them, joined by NUL under
    "2/<n>/<id>" (no JSON encoding in FINISH); the previous release's parser finds no job of
    that id in it, so its waiter reads the job when the "done" wakes it."""
    state, _, text = clients
    job_id = str(uuid.uuid4())
    message = _sent(text, lambda channel: _run(state, channel, job_id=job_id))
    head, rest = message.split(b"\n", 1)
    key, fields_size, _ = head.split(b" ")
    parts = rest[:int(fields_size)].split(b"\0")
    assert key == f"2/{len(parts)}/{job_id}".encode()
    written = dict(zip(parts[::2], parts[1::2]))
    assert written == {k.encode(): v.encode()
                       for k, v in text.hgetall(job_key(job_id)).items()}
    assert job_id not in _before(message)
    entry = announced(message)[job_id]
    assert announced_record(job_id, entry) == state.read(job_id)


def test_a_failure_and_the_release_befores_success_are_read_as_json_by_both(clients):
    """A job that did not succeed is still announced as every release sent it, a JSON array
    under its id: the release before reads it; and this release reads a success the release
    before's FINISH announced so (its FIELDS as JSON), as a read finds it."""
    state, _, text = clients
    job_id = str(uuid.uuid4())
    message = _sent(text, lambda channel: _run(state, channel, "failed", job_id))
    assert _before(message)[job_id] == announced(message)[job_id][:2]
    assert announced_record(job_id, announced(message)[job_id]) == state.read(job_id)
    done = _run(state, "")
    values = text.hmget(job_key(done), job_lua.READ_FIELDS)
    stored = _binary(text).get(result_key(done))
    fields = json.dumps(values).encode()
    old = f"{done} {len(fields)} {len(stored)}\n".encode() + fields + stored
    assert announced_record(done, announced(old)[done]) == state.read(done)


def test_joined_fields_that_do_not_split_into_their_count_are_left_to_a_read():
    """A value holding a NUL would split into more strings than were sent: no answer (None),
    so the waiter reads the job rather than answer with misplaced fields."""
    fields = b"\0".join([b"status", b"succeeded", b"model", b"a\0b", b"created_at", b"1"])
    message = f"2/6/j1 {len(fields)} 0\n".encode() + fields
    assert announced_record("j1", announced(message)["j1"]) is None
