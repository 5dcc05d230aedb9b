"""What the hot job scripts hand Redis's commands (issue 40, Redis's time a job), on a real
Redis, by MONITOR: FINISH reads only the fields a record not final can hold, a submit sends no
field its script writes itself, and the numbers the hot moves pass go as text (a number given
to redis.call is written out with sprintf on every call). The records read and written are
those of before: tests/integration/test_job_bytes.py and test_jobstate.py say so."""
from __future__ import annotations

import re
import uuid

import pytest
import redis

from bench.purposes import Monitor
from tasks import job_lua, results
from tasks.jobstate import Final, JobState, StartDecision, Status, new_job
from tasks.keys import job_key
from tasks.messages import QueuedMessage

FINAL_ONLY = set(job_lua.FINAL_ONLY)


@pytest.fixture
def state(redis_server, clean_admin):
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    return JobState(client, keep_s=600, ttl_s=600)


def _monitored(admin_url: str, admin: redis.Redis, move) -> list[list[str]]:
    """The commands scripts ran during `move`, each as its words (MONITOR's lines)."""
    monitor = Monitor(admin_url)
    try:
        move()
        admin.echo("moved")
        deadline = 200
        while b'"moved"' not in b"".join(monitor.chunks) and deadline:
            monitor.thread.join(0.05)
            deadline -= 1
    finally:
        lines = monitor.stop()
    return [re.findall(r'"((?:[^"\\]|\\.)*)"', line.decode(errors="replace"))
            for line in lines if b" lua]" in line]


def _submitted(state: JobState) -> tuple[str, str]:
    job = new_job(str(uuid.uuid4()), model="m", trace_id="t", inputs=1, priority="normal",
                  token="tok")
    state.submit(job, QueuedMessage("m", b"x" * 100), depth_lists=["m"], max_depth=None,
                 ttl_s=600)
    return job.id, job.token


def test_finish_reads_only_the_fields_a_record_not_final_holds(state, redis_server,
                                                                clean_admin):
    job_id, token = _submitted(state)
    assert state.start([job_id], worker="w/0", batch="b 1 1", tokens=[token]) == \
        [StartDecision.RUN]
    final = Final(job_id, Status.SUCCEEDED, results.stored(job_id, outputs=[[0.5]]),
                  token=token)
    ran = _monitored(redis_server.extra["admin_url"], clean_admin,
                     lambda: state.finish([final], result_ttl_s=60, model_version="v1"))
    reads = [words[2:] for words in ran if words[0] == "hmget" and words[1] == job_key(job_id)]
    assert reads == [list(job_lua.SUCCEEDED_READ)]
    assert not FINAL_ONLY & set(reads[0])
    done = state.read(job_id)
    assert (done.status, done.model_version, done.runs) == (Status.SUCCEEDED, "v1", 1)


def test_finish_reads_every_field_a_succeeded_record_keeps():
    """Its read is by position: a field a record gains (READ_FIELDS) is kept by a success only
    once it is added to SUCCEEDED_READ and to FINISH's locals."""
    kept = [name for name in job_lua.KEEP_FIELDS if name not in FINAL_ONLY]
    assert list(job_lua.SUCCEEDED_READ) == [*kept, "reply", "req", "charged"]
    assert FINAL_ONLY <= set(job_lua.KEEP_FIELDS)


def test_a_submit_sends_no_status_its_script_writes_first(state, redis_server, clean_admin):
    ran = _monitored(redis_server.extra["admin_url"], clean_admin, lambda: _submitted(state))
    record = [words for words in ran if words[0] in ("hsetnx", "hset")
              and words[1].startswith("iq:job:")]
    assert [w[:3] for w in record][0] == ["hsetnx", record[0][1], "status"]
    written = record[1][2::2]
    assert record[1][0] == "hset" and "status" not in written and "model" in written
    assert clean_admin.hget(record[0][1], "status") == "queued"


@pytest.mark.parametrize("script, calls", [
    (job_lua.SUBMIT, ("redis.call('expire', record, TTL_TEXT)",
                      "redis.call('zadd', pending, now_text, id)")),
    (job_lua.FINISH, ("redis.call('expire', key, TTL_TEXT)",
                      "redis.call('set', meta_key, ARGV[a + 2], 'EX', ttl)",
                      "string.format('%s %d %d\\n', id, #fields, #stored)",
                      "finished_ms % 1 == 0 and '%d %d %s %s %s'")),
    (job_lua.START, ("'runs', f[4] and tostring(tonumber(f[4]) + 1) or '1')",))],
    ids=["submit", "finish", "start"])
def test_the_hot_moves_pass_their_numbers_as_text(script, calls):
    """Each job's TTLs, its pending set's score and its runs count reach redis.call as strings
    made once a call (or not at all): a number there is sprintf'ed every call; FINISH writes
    whole numbers (a packed record's times, a reply's lengths) by %d, not by a float's path
    (%.0f, or %.14g for a number concatenated)."""
    for call in calls:
        assert call in script
    assert "redis.call('expire', record, TTL_S)" not in script
    assert "redis.call('zadd', pending, now, id)" not in script
