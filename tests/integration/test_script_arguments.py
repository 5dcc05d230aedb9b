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
from scripts.processes import wait_until
from tasks import job_lua, results
from tasks.jobstate import Final, JobState, Overloaded, StartDecision, Status, new_job
from tasks.keys import PENDING_KEY, job_key, owner_jobs
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
    assert [w[:4] for w in record] == [["hset", record[0][1], "status", "queued"]]
    assert "model" in record[0][2::2]
    assert clean_admin.hget(record[0][1], "status") == "queued"


def test_a_submit_writes_its_record_with_one_command_and_a_refusal_writes_none(
        state, redis_server, clean_admin):
    """The record is written by one HSET once every check has passed, its status first (not a
    HSETNX that begins it and a HSET that adds the rest: a command a job more, and Redis
    converting the one-field compact hash when the large values come); a resend finds it by
    EXISTS and writes nothing; a refused submit (a full queue) leaves no record and runs no
    DEL to take one back."""
    ran = _monitored(redis_server.extra["admin_url"], clean_admin, lambda: _submitted(state))
    record = next(w[1] for w in ran if w[0] == "exists")
    assert record.startswith(job_key(""))
    on_it = [w[0] for w in ran if len(w) > 1 and w[1] == record]
    assert on_it == ["exists", "hset", "expire"], on_it
    job = new_job(str(uuid.uuid4()), model="m", trace_id="t", inputs=1, priority="normal",
                  token="tok")
    ran = _monitored(redis_server.extra["admin_url"], clean_admin, lambda: pytest.raises(
        Overloaded, state.submit, job, QueuedMessage("m", b"x" * 100), depth_lists=["m"],
        max_depth=1, ttl_s=600))
    assert [w[0] for w in ran if len(w) > 1 and w[1] == job_key(job.id)] == ["exists"]
    assert not [w for w in ran if w[0] in ("del", "hsetnx")]
    assert not clean_admin.exists(job_key(job.id))


@pytest.mark.parametrize("script, calls", [
    (job_lua.SUBMIT, ("redis.call('expire', record, TTL_TEXT)",
                      "adds[#adds + 1] = now_text",
                      "redis.call('lindex', owned, '0')")),
    (job_lua.FINISH, ("redis.call('expire', key, TTL_TEXT)",
                      "redis.call('set', meta_key, ARGV[a + 2], 'EX', ttl)",
                      "id .. string.format(' %d %d\\n', #fields, #stored)",
                      "finished_ms % 1 == 0 and '%d %d '")),
    (job_lua.START, ("'runs', f[4] and tostring(tonumber(f[4]) + 1) or '1')",))],
    ids=["submit", "finish", "start"])
def test_the_hot_moves_pass_their_numbers_as_text(script, calls):
    """Each job's TTLs, its pending set's score and its runs count reach redis.call as strings
    made once a call (or not at all): a number there is sprintf'ed every call; FINISH writes
    whole numbers (a packed record's times, a reply's lengths) by %d, not by a float's path
    (%.0f, or %.14g for a number concatenated), and joins strings rather than format them."""
    for call in calls:
        assert call in script
    assert "redis.call('expire', record, TTL_S)" not in script
    # Strings are joined, not formatted: each %s of string.format is a sprintf call.
    assert "%s" not in "".join(re.findall(r"string\.format\('([^']*)'", script))
    assert "redis.call('zadd', pending, now, id)" not in script
    assert "redis.call('lindex', owned, 0)" not in script


def test_the_pending_set_scores_a_job_by_whole_seconds_rounded_up(state, redis_server,
                                                                   clean_admin):
    """A whole-number score is stored as an integer in the pending set's compact form, so a
    submit's ZADD neither sprintf's it nor strtod's each member's score to find its place; it
    is rounded up, so that the reconciler (a job not final for longer than a lease) never
    looks at a job early."""
    before = clean_admin.time()
    ran = _monitored(redis_server.extra["admin_url"], clean_admin, lambda: _submitted(state))
    after = clean_admin.time()
    zadds = [words for words in ran if words[0] == "zadd" and words[1] == PENDING_KEY]
    assert len(zadds) == 1 and re.fullmatch(r"\d+", zadds[0][2]), zadds
    score = int(zadds[0][2])
    assert before[0] + before[1] / 1e6 <= score <= after[0] + 1
    assert clean_admin.zscore(PENDING_KEY, zadds[0][3]) == score


def test_a_group_of_submits_is_answered_with_one_string_a_job(state, clean_admin):
    """SUBMIT_MANY answers "kind found" a job, not a table of two strings a job: Redis makes a
    script's reply value by value; and it is told each job's counts of keys and arguments in
    one argument, two bytes a job (read without strtod), not two arguments a job. What each
    submit is told, and what each job's record holds, is as before."""
    class Collect:
        calls: list = []

        def submit(self, call):
            self.calls.append(call)
            return ["created", call[1][0]]

    collect, replies, run = Collect(), [], state._run
    state._grouped = collect
    jobs = [_submitted(state)[0] for _ in range(3)]

    def recorded(name, keys, args, ttl_s=None):
        sent.append(args)
        replies.append(run(name, keys, args, ttl_s))
        return replies[-1]

    sent: list = []
    state._run = recorded
    answers = state._submit_many(collect.calls)
    assert replies == [[f"created {job_id}" for job_id in jobs]]
    assert answers == [["created", job_id] for job_id in jobs]
    nargs = len(collect.calls[0][1])
    assert sent[0][0] == bytes([8, nargs] * 3) and len(sent[0]) == 1 + 3 * nargs
    for job_id in jobs:
        assert clean_admin.hget(job_key(job_id), "trace_id") == "t"


def test_a_submit_sends_no_name_its_script_knows_nor_what_it_can_tell(state, redis_server,
                                                                       clean_admin):
    """Each argument costs Redis ~1,000 instructions: a submit sends the values of the fields
    every record has (model, created_at, trace_id, inputs) without their names, and neither
    whether it retries a job (the retried record's place says) nor what to trim (its id says)."""
    monitor = Monitor(redis_server.extra["admin_url"])
    try:
        job_id, _token = _submitted(state)
        clean_admin.echo("moved")
        wait_until(lambda: b'"moved"' in b"".join(monitor.chunks), 10, "MONITOR's lines")
    finally:
        lines = monitor.stop()
    sent = [re.findall(r'"((?:[^"\\]|\\.)*)"', line.decode(errors="replace"))
            for line in lines if b'"evalsha"' in line.lower() and b" lua]" not in line]
    assert len(sent) == 1, sent
    nkeys = int(sent[0][2])
    args = sent[0][3 + nkeys:]
    assert args[2] == job_id
    assert not {"model", "created_at", "trace_id", "inputs"} & set(args), args
    # The two of every job script, 11 of its own, the four values, then token's pair.
    assert len(args) == 2 + 11 + 4 + 2, args
    assert args[13:17] == ["m", args[14], "t", "1"] and args[17:] == ["token", "tok"]


def test_start_reads_a_queued_jobs_batch_and_worker_not(state, redis_server, clean_admin):
    """START reads a queued job's status, deadline, token and runs; its batch and worker (to
    tell a start sent again, which counts once) only for a job running already."""
    job_id, token = _submitted(state)
    start = lambda: state.start([job_id], worker="w/0", batch="b 1 1", tokens=[token])  # noqa: E731
    ran = _monitored(redis_server.extra["admin_url"], clean_admin,
                     lambda: start() == [StartDecision.RUN] or pytest.fail("not run"))
    reads = [words[2:] for words in ran if words[0] in ("hmget", "hget")
             and words[1] == job_key(job_id)]
    assert reads == [["status", "expires_at", "token", "runs"]]
    again = _monitored(redis_server.extra["admin_url"], clean_admin,
                       lambda: start() == [StartDecision.RUN] or pytest.fail("not run"))
    assert [w[2:] for w in again if w[0] == "hget"] == [["batch"], ["worker"]]
    assert state.read(job_id).runs == 1  # the start sent again counted once


def _group_calls(state: JobState, count: int, max_depth: int | None = None,
                 owner: str | None = None) -> list:
    """`count` submits to list "m" as an API process's group commit holds them: (keys, args);
    each of its own owner, or all of `owner`'s."""
    class Collect:
        def __init__(self) -> None:
            self.calls: list = []

        def submit(self, call):
            self.calls.append(call)
            return ["created", call[1][0]]

    collect, grouped = Collect(), state._grouped
    state._grouped = collect
    try:
        for i in range(count):
            job = new_job(str(uuid.uuid4()), model="m", trace_id="t", inputs=1,
                          priority="normal", token="tok",
                          owner=f"owner-{i}" if owner is None else owner)
            state.submit(job, QueuedMessage("m", b"message %d " % i + b"x" * 100),
                         depth_lists=["m"], max_depth=max_depth, ttl_s=600)
    finally:
        state._grouped = grouped
    return collect.calls


def test_a_group_of_submits_queues_with_one_push_and_one_pending_add(state, redis_server,
                                                                     clean_admin):
    """A call's jobs reach their queue list by one LPUSH and the pending set by one ZADD (each
    command a script runs costs Redis its call, its reply and its line in the append-only
    file): the list holds the messages in the order their jobs came, newest at the head, as a
    push a job left it; the pending set every job; the queue's idle workers one wake-up."""
    calls = _group_calls(state, 4)
    ran = _monitored(redis_server.extra["admin_url"], clean_admin,
                     lambda: state._submit_many(calls))
    ids = [call[1][0] for call in calls]
    assert [w[0] for w in ran if w[0] in ("lpush", "zadd") and w[1] in ("m", PENDING_KEY)] == \
        ["lpush", "zadd"]
    assert clean_admin.lrange("m", 0, -1) == [
        f"message {i} " + "x" * 100 for i in reversed(range(4))]
    assert sorted(clean_admin.zrange(PENDING_KEY, 0, -1)) == sorted(ids)
    wakes = [w for w in ran if w[0] == "lpush" and w[1] not in ("m",)
             and not w[1].startswith("iq:owner")]
    assert len([w for w in wakes if "wake" in w[1]]) == 1, wakes
    for job_id in ids:
        assert clean_admin.hget(job_key(job_id), "status") == "queued"


def test_a_groups_depth_check_counts_the_messages_its_earlier_jobs_queue(state, clean_admin):
    """Queued at the call's end, a job's message still counts toward the depth a later job of
    the same call is checked against: two of three fit a queue of depth 2."""
    calls = _group_calls(state, 3, max_depth=2)
    answers = state._submit_many(calls)
    assert [kind for kind, _found in answers] == ["created", "created", "overloaded"]
    assert clean_admin.llen("m") == 2
    assert not clean_admin.exists(job_key(calls[2][1][0]))


def test_a_group_whose_job_fails_midway_queues_the_jobs_before_it(state, clean_admin):
    """Should a job's command fail inside the call (a key of the wrong type), the jobs before
    it, whose records are written, are queued all the same, as when each job queued its own:
    resent, they find their records and are not queued again."""
    calls = _group_calls(state, 3)
    clean_admin.set(calls[1][0][3], "not a list")  # the second job's owner's jobs list
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        state._submit_many(calls)
    first = calls[0][1][0]
    assert clean_admin.lrange("m", 0, -1) == ["message 0 " + "x" * 100]
    assert clean_admin.zscore(PENDING_KEY, first) is not None
    assert not clean_admin.exists(job_key(calls[2][1][0]))


def test_a_groups_jobs_ask_for_their_records_once_and_read_and_push_an_owners_list_once(
        state, redis_server, clean_admin):
    """A call's jobs are checked for a record there already (a resend) by one EXISTS of them
    all, and an owner's jobs list is read (its head's time) and pushed once a call, not once a
    job (issue 40: commands a job): the list holds what a push a job left, newest first, each
    entry stamped after the one before; the call sent again finds every record and queues
    nothing twice."""
    calls = _group_calls(state, 4, owner="o")
    ids = [call[1][0] for call in calls]
    ran = _monitored(redis_server.extra["admin_url"], clean_admin,
                     lambda: state._submit_many(calls))
    assert [w[1:] for w in ran if w[0] == "exists"] == [[job_key(i) for i in ids]]
    owned = owner_jobs("o")
    # (Its head read, its entries pushed; a trim, one id in 16 (_submit.lua), reads its tail.)
    assert [(w[0], len(w) - 2) for w in ran if len(w) > 1 and w[1] == owned
            and w[:3] != ["lindex", owned, "-1"] and w[0] != "llen"] == \
        [("lindex", 1), ("lpush", 4)]
    raw = redis.Redis.from_url(redis_server.extra["url"]).lrange(owned, 0, -1)
    assert [uuid.UUID(bytes=entry[7:]) for entry in raw] == [uuid.UUID(i) for i in reversed(ids)]
    stamps = [int.from_bytes(entry[:7], "big") for entry in raw]
    assert stamps == sorted(stamps, reverse=True) and len(set(stamps)) == 4
    assert [job.id for job in state.page("o").jobs] == list(reversed(ids))
    again = _monitored(redis_server.extra["admin_url"], clean_admin,
                       lambda: state._submit_many(calls))
    assert [w[0] for w in again if w[0] == "exists"] == ["exists"] * 5
    assert not [w for w in again if w[0] in ("hset", "lpush")]
    assert clean_admin.llen("m") == 4 and clean_admin.llen(owned) == 4


def test_a_group_that_holds_one_job_twice_makes_it_once(state, clean_admin):
    """Its records asked for once, a call still finds the record an earlier job of the same
    call wrote: a job twice in one call is made once, queued once."""
    calls = _group_calls(state, 2, owner="o")
    answers = state._submit_many([calls[0], calls[1], calls[0]])
    assert answers == [["created", calls[0][1][0]], ["created", calls[1][1][0]],
                       ["created", calls[0][1][0]]]
    assert clean_admin.llen("m") == 2 and clean_admin.llen(owner_jobs("o")) == 2
    assert clean_admin.zcard(PENDING_KEY) == 2


def test_a_submit_without_an_idempotency_key_names_one_claim_key_for_every_job(state,
                                                                               clean_admin):
    """The claim's place holds one key for every job without an Idempotency-Key (never read
    nor written: the script touches the claim only with a key's digest), so that a call's jobs
    hand Lua one string, not one a job."""
    calls = _group_calls(state, 3, owner="o")
    assert {call[0][1] for call in calls} == {job_lua.NO_CLAIM}
    state._submit_many(calls)
    assert not clean_admin.exists(job_lua.NO_CLAIM)
    assert all(clean_admin.hget(job_key(call[1][0]), "status") == "queued" for call in calls)


def test_finish_builds_a_succeeded_record_without_a_function_a_field():
    """A succeeded record's fields are put in its HSET's arguments inline: a closure made a job
    and a call a field (25 a job) cost Redis more than the fields (~12k instructions a job by
    callgrind). What is written is as before: tests/integration/test_job_bytes.py."""
    body = job_lua.FINISH.split("local function succeeded(", 1)[1].split("\nend\n", 1)[0]
    assert "function" not in body
    assert "'webhook_id', hook_id" in body and "'token', token" in body
