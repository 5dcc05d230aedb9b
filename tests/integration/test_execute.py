"""A batch as a pool child runs it (workers/child/execute.py), on a real Redis with the real job
state, its model a stand-in: each step's outcome per job, and what is stored."""
from __future__ import annotations

import base64
import uuid
from types import SimpleNamespace

import orjson
import pytest
import redis

from config import load_settings
from tasks.errors import ErrorCode, JobError
from tasks.jobstate import JobState, StartDecision, Status, new_job
from tasks.messages import JobArgs, QueuedMessage
from tasks.names import PRIORITIES, list_for
from tasks.webhooks import QUEUE as WEBHOOK_QUEUE
from workers.child.batch import BatchJob, Outcome, succeeded
from workers.child.execute import execute


class Runtime:
    """What `execute` asks of a child's runtime, with a model that doubles its inputs and
    fails any input of "boom"."""

    def __init__(self, client: redis.Redis, url: str) -> None:
        self.ready = True
        self.member = "w@test/0"
        self.settings = load_settings({"redis_url": url, "redis_retry_s": 0}, environ={})
        self.jobs = JobState(client)
        self.versions = {"m": "v1"}  # model → the version this child serves
        self.calls: list[list] = []

    def run(self, model: str, jobs: list[tuple[list, dict]], progress=None,
            waiting_since=None) -> list:
        self.calls.append([inputs for inputs, _options in jobs])
        return [JobError(ErrorCode.INFERENCE_ERROR, "boom") if "boom" in inputs
                else [[float(len(x)), 0.5] for x in inputs] for inputs, _options in jobs]

    def record_memory(self, model: str) -> None:
        pass


@pytest.fixture
def setup(redis_server):
    from tasks.celery_app import make_celery

    url = redis_server.extra["url"]
    client = redis.Redis.from_url(url, decode_responses=True)
    redis.Redis.from_url(redis_server.extra["admin_url"]).flushdb()
    app = make_celery(load_settings({"redis_url": url}, environ={}))
    return app, Runtime(client, url), client


def queued(rt: Runtime, inputs: list, encoding_format: str = "float", **args) -> BatchJob:
    job_id = str(uuid.uuid4())
    rt.jobs.submit(new_job(job_id, model="m", trace_id="t", inputs=len(inputs),
                           priority="normal", encoding_format=encoding_format),
                   QueuedMessage("q", b"{}"), depth_lists=["q"], max_depth=100, ttl_s=60)
    return BatchJob(job_id, JobArgs(inputs, {}, **args), {"trace_id": f"trace-{job_id}"})


def test_a_batch_runs_its_runnable_jobs_in_one_call_and_stores_each(setup):
    app, rt, client = setup
    hook = {"events": ["succeeded", "failed"]}  # its URL is in the record (tasks/webhooks.py)
    ok = queued(rt, ["ab", "c"], encoding_format="base64", webhook=hook)
    bad = queued(rt, ["boom"], webhook=hook)
    cancelled = queued(rt, ["x"])
    rt.jobs.cancel(cancelled.id)

    outcomes = {o.job_id: o for o in execute(app, rt, "m", [ok, bad, cancelled])}

    assert rt.calls == [[["ab", "c"], ["boom"]]]  # one model call; the cancelled job left out
    assert outcomes[ok.id].outcome is Outcome.SUCCEEDED and outcomes[ok.id].outputs == 2
    assert outcomes[bad.id].outcome is Outcome.FAILED
    assert outcomes[bad.id].error == JobError(ErrorCode.INFERENCE_ERROR, "boom")
    assert outcomes[cancelled.id].outcome is Outcome.NOT_RUN
    assert outcomes[cancelled.id].reason is StartDecision.CANCELLED
    done, failed = rt.jobs.read(ok.id), rt.jobs.read(bad.id)
    assert done.status is Status.SUCCEEDED and done.runs == 1 and done.worker.startswith("w@")
    assert done.outputs == ["AAAAQAAAAD8=", "AACAPwAAAD8="]  # base64 float32, as it asked
    assert done.batch["jobs"] == 3 and done.batch == failed.batch
    assert failed.status is Status.FAILED and failed.error.code is ErrorCode.INFERENCE_ERROR
    # One delivery per finished job that asked for one, queued with its result.
    queue = list_for(WEBHOOK_QUEUE, PRIORITIES["normal"])
    deliveries = {m["headers"]["id"]: m for m in map(orjson.loads, client.lrange(queue, 0, -1))}
    assert len(deliveries) == 2
    kwargs = [orjson.loads(base64.b64decode(m["body"]))[1] for m in deliveries.values()]
    assert sorted(k["event"] for k in kwargs) == ["failed", "succeeded"]
    assert {k["job_id"] for k in kwargs} == {ok.id, bad.id}


def test_a_job_finished_by_an_earlier_run_keeps_its_result(setup):
    app, rt, _client = setup
    job = queued(rt, ["ab"])

    def another_run_finishes_first(model: str, jobs: list, progress=None,
                                   waiting_since=None) -> list:
        # The same job, delivered twice, finished by the other run while this one ran.
        rt.jobs.finish([succeeded(app, job, [[2.0, 0.5]])], result_ttl_s=60)
        return [[[9.0]]]

    rt.run = another_run_finishes_first
    [outcome] = execute(app, rt, "m", [job])
    assert outcome.outcome is Outcome.NOT_RUN and outcome.reason is StartDecision.FINISHED
    assert rt.jobs.read(job.id).outputs == [[2.0, 0.5]]


def test_a_child_that_cannot_run_puts_every_job_back(setup):
    app, rt, _client = setup
    rt.ready, rt.state = False, SimpleNamespace(value="defunct")
    job = queued(rt, ["ab"])
    assert [o.outcome for o in execute(app, rt, "m", [job])] == [Outcome.RETRY]
    assert rt.jobs.read(job.id).status is Status.QUEUED and rt.calls == []
