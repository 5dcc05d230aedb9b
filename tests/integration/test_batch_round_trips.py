"""A batch's way through Redis in as few round trips as its promises allow (issue 40), on a real
Redis: the finish that stores a batch's results acknowledges their messages in the same script
call (the worker sends no acknowledgement of its own), and the submits of one group read
Redis's memory once, each still refused past the headroom."""
from __future__ import annotations

import secrets
import uuid

import pytest
import redis

from bench.purposes import Monitor
from scripts.processes import wait_until
from scripts.stack import launch
from tasks import results
from tasks.jobstate import Final, JobState, Status, new_job
from tasks.keys import job_key, result_key
from tasks.messages import QueuedMessage

INFLIGHT = "iq:inflight:test"


@pytest.fixture
def state(redis_server, clean_admin):
    client = redis.Redis.from_url(redis_server.extra["url"], decode_responses=True)
    return JobState(client, keep_s=600, ttl_s=600)


def _calls(admin: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"]
            for k, v in admin.info("commandstats").items()}


def _queued(state: JobState, n: int, payload: bytes = b"m") -> list:
    jobs = []
    for _ in range(n):
        job = new_job(str(uuid.uuid4()), model="embed", trace_id="t", inputs=1,
                      priority="normal", token=secrets.token_urlsafe(6))
        state.submit(job, QueuedMessage("embed", payload), depth_lists=["embed"],
                     max_depth=None, ttl_s=600)
        jobs.append(job)
    return jobs


def test_a_finish_stores_the_results_and_acknowledges_their_messages_in_one_call(
        state, clean_admin):
    jobs = _queued(state, 3)
    tags = [f"tag-{i}" for i in range(3)]
    clean_admin.hset(INFLIGHT, mapping={**{t: "embed\nm" for t in tags}, "other": "embed\nm"})
    state.start([j.id for j in jobs], worker="w/1", batch="b 3 3",
                tokens=[j.token for j in jobs], held=(INFLIGHT, tags))
    # The first job was finished by an earlier run (a redelivered message): this finish
    # changes nothing of it, and its message is acknowledged all the same.
    assert state.finish([Final(jobs[0].id, Status.SUCCEEDED, b"earlier", token=jobs[0].token)],
                        result_ttl_s=60) == [True]
    before = _calls(clean_admin)
    finals = [Final(j.id, Status.SUCCEEDED, results.stored(j.id, outputs=[[0.5]]),
                    token=j.token) for j in jobs]
    written = state.finish(finals, result_ttl_s=60, held=(INFLIGHT, tags))
    after = _calls(clean_admin)
    assert written == [False, True, True]
    assert after["evalsha"] - before["evalsha"] == 1  # one round trip: results and acks
    assert after["hdel"] - before.get("hdel", 0) == 1  # inside it, one HDEL for the batch
    assert clean_admin.hkeys(INFLIGHT) == ["other"]  # another batch's message stays
    assert clean_admin.get(result_key(jobs[0].id)) == "earlier"
    for job in jobs[1:]:
        assert clean_admin.hget(job_key(job.id), "status") == Status.SUCCEEDED.value
        assert clean_admin.exists(result_key(job.id))


def test_the_submits_of_a_group_read_redis_memory_once_and_each_is_checked(state, clean_admin):
    """One INFO for the group, the bytes each job wrote added to it: a group that would take
    Redis past its headroom has its later jobs refused, as one submit at a time would."""
    class Collect:  # an API process's group commit, holding the calls to send together
        def __init__(self) -> None:
            self.calls: list = []

        def submit(self, call):
            self.calls.append(call)
            return ["created", call[1][0]]

    big = b"x" * 300_000
    used = int(clean_admin.info("memory")["used_memory"])
    # The script call's own arguments (1.5 MB) take Redis's memory up before it reads it;
    # the headroom (10 %) leaves room above that for some of these jobs, not all five.
    clean_admin.config_set("maxmemory", int((used + 3_200_000) / 0.9))
    collect = Collect()
    state._grouped = collect
    jobs = []
    for _ in range(5):
        job = new_job(str(uuid.uuid4()), model="embed", trace_id="t", inputs=1,
                      priority="normal")
        state.submit(job, QueuedMessage("embed", big), depth_lists=["embed"], max_depth=None,
                     ttl_s=600, memory_headroom=0.1)
        jobs.append(job)
    before = _calls(clean_admin)
    answers = state._submit_many(collect.calls)
    after = _calls(clean_admin)
    assert after["info"] - before["info"] == 2  # the group's, and this reading's own
    kinds = [a[0] for a in answers]
    made = kinds.count("created")
    assert 0 < made < 5 and kinds == ["created"] * made + ["full"] * (5 - made), kinds
    assert clean_admin.llen("embed") == kinds.count("created")
    for job, kind in zip(jobs, kinds):
        assert clean_admin.exists(job_key(job.id)) == (kind == "created")


QUICK = {"quick": {"kind": "synthetic", "base_ms": 5, "per_item_ms": 0, "max_batch_size": 16}}


def test_the_worker_sends_no_acknowledgement_of_its_own_for_a_finished_batch(tmp_path):
    """A batch's start, then its finish with its acknowledgements: the worker's main process
    leaves the in-flight hash to the child's finish, and the hash ends empty."""
    stack = launch(tmp_path, QUICK, {"w": ["quick"]})
    try:
        monitor = Monitor(stack.redis_svc.extra["admin_url"])
        try:
            jobs = [stack.submit("quick", ["a"])["id"] for _ in range(12)]
            assert all(stack.finished(j)["status"] == "succeeded" for j in jobs)
            stack.admin.echo("finished")
            wait_until(lambda: b'"finished"' in b"".join(monitor.chunks), 10, "the ECHO")
        finally:
            lines = monitor.stop()
        hdels = [line for line in lines if b'"hdel" "iq:inflight:' in line.lower()]
        assert hdels, "no acknowledgement seen at all"
        assert all(b" lua]" in line for line in hdels), \
            [line for line in hdels if b" lua]" not in line][:3]
        held = [k for k in stack.admin.scan_iter("iq:inflight:*")]
        assert all(stack.admin.hlen(k) == 0 for k in held)
    finally:
        stack.stop()
