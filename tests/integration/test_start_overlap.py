"""A batch's start overlapped with its model (workers/child/execute.py `_start_and_run`), on a
real Redis with the real job state, its model a stand-in: the start is sent, the model runs
over the whole batch, and the start's answer is read only then; what the start refused is run
for nothing, and never stored nor counted."""
from __future__ import annotations

import threading

import redis

from tasks.jobstate import StartDecision, Status
from tasks.keys import job_key, result_key
from tests.integration.test_execute import Runtime, queued, setup  # noqa: F401 - a fixture
from workers.child.batch import Outcome
from workers.child.execute import execute

PAUSE_MS = 20_000  # bounds a test run without the overlap: its start would wait this long


def paused_writes(admin: redis.Redis) -> None:
    admin.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")


def test_the_start_is_answered_after_the_model_ran(setup, redis_server):
    app, rt, _client = setup
    admin = redis.Redis.from_url(redis_server.extra["admin_url"], decode_responses=True)
    jobs = [queued(rt, ["ab"]), queued(rt, ["c", "d"])]
    seen: list[list[str]] = []

    def look() -> None:
        seen.append([rt.jobs.client.hget(job_key(job.id), "status") for job in jobs])

    def model(name: str, batch: list, progress=None, waiting_since=None) -> list:
        # Redis holds every write: the start was sent and not run, so not answered either.
        # Read through the child's own client from another thread, as its heartbeat writes:
        # on a connection of its own, not the one that waits for the start's answer.
        reader = threading.Thread(target=look)
        reader.start()
        reader.join(10)
        admin.execute_command("CLIENT", "UNPAUSE")
        return [[[1.0]] * len(inputs) for inputs, _options in batch]

    rt.run = model
    paused_writes(admin)
    try:
        outcomes = execute(app, rt, "m", jobs)
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    assert seen == [["queued", "queued"]]
    assert [o.outcome for o in outcomes] == [Outcome.SUCCEEDED] * 2
    for job in jobs:
        record = rt.jobs.read(job.id)
        assert record.status is Status.SUCCEEDED and record.runs == 1


def test_a_job_cancelled_just_before_its_batchs_start_is_run_but_never_stored_or_counted(
        setup):
    app, rt, client = setup
    kept, victim = queued(rt, ["ab"]), queued(rt, ["x", "y"])
    rt.jobs.cancel(victim.id)  # after the worker took its message, before the batch started

    outcomes = {o.job_id: o for o in execute(app, rt, "m", [kept, victim])}

    assert rt.calls == [[["ab"], ["x", "y"]]]  # the model ran over it
    assert outcomes[victim.id].outcome is Outcome.NOT_RUN
    assert outcomes[victim.id].reason is StartDecision.CANCELLED
    assert outcomes[kept.id].outcome is Outcome.SUCCEEDED
    record = rt.jobs.read(victim.id)
    assert record.status is Status.CANCELLED and client.hget(job_key(victim.id), "runs") is None
    assert record.started_at is None and record.outputs is None
    assert not client.exists(result_key(victim.id))
    assert rt.jobs.read(kept.id).runs == 1 and client.exists(result_key(kept.id))


def test_progress_is_never_written_to_a_job_the_start_refused(setup):
    """A batch split between model calls (out of memory) counts the items of its part-done
    jobs: only of those its start ran. A refused one (here a job whose message this worker's
    lease lost, running elsewhere since) is not this batch's to touch, though the model ran
    over it."""
    app, rt, client = setup
    mine, elsewhere = queued(rt, ["a", "b"])._replace(tag="1"), queued(rt, ["c", "d"])
    assert rt.jobs.start([elsewhere.id], worker="w@other/0/1", batch="b 1 2") == \
        [StartDecision.RUN]
    client.hset("iq:inflight:test", "1", "its message")  # the other's tag ("2") is gone

    def halved(name: str, batch: list, progress=None, waiting_since=None) -> list:
        for done in (1, 2, 3, 4):  # one item a call
            progress(done)
        return [[[1.0]] * len(inputs) for inputs, _options in batch]

    rt.run = halved
    outcomes = {o.job_id: o for o in execute(app, rt, "m", [mine, elsewhere._replace(tag="2")],
                                             held_by="iq:inflight:test")}

    assert outcomes[elsewhere.id].reason is StartDecision.LAPSED
    assert outcomes[mine.id].outcome is Outcome.SUCCEEDED
    assert rt.jobs.read(elsewhere.id).status is Status.RUNNING
    assert client.hget(job_key(elsewhere.id), "items_done") is None
    assert client.hget(job_key(mine.id), "items_done") == "1"


def test_a_start_whose_answer_is_lost_is_sent_again_and_counted_once(setup, redis_server):
    """The connection that carried the start is cut before Redis ran it (its writes were
    held): the model's work is kept, and the start is sent again, waited for this time."""
    app, rt, _client = setup
    admin = redis.Redis.from_url(redis_server.extra["admin_url"], decode_responses=True)
    jobs = [queued(rt, ["ab"]), queued(rt, ["c"])]

    def model(name: str, batch: list, progress=None, waiting_since=None) -> list:
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        admin.execute_command("CLIENT", "UNPAUSE")
        return [[[1.0]] * len(inputs) for inputs, _options in batch]

    rt.run = model
    paused_writes(admin)
    try:
        outcomes = execute(app, rt, "m", jobs)
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    assert [o.outcome for o in outcomes] == [Outcome.SUCCEEDED] * 2
    for job in jobs:
        record = rt.jobs.read(job.id)
        assert record.status is Status.SUCCEEDED and record.runs == 1
