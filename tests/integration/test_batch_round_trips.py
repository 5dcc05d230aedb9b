"""A batch's way through Redis in as few round trips and commands as its promises allow (issue
40), on a real Redis: the submits of one group read Redis's memory once, each still refused
past the headroom."""
from __future__ import annotations

import secrets
import uuid

import pytest
import redis

from tasks.jobstate import JobState, new_job
from tasks.keys import job_key
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
