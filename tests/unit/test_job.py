"""A job held by the worker's main process (workers/batching/job.py): Celery's books hold the
`Job` itself; its Celery Request is built only where something asks for what only a Request
answers, once, and takes what Celery set on the job meanwhile; Celery's own handling of the
Request taking it off the books takes the job off them too."""
from __future__ import annotations

from celery import Celery
from celery.worker import state as worker_state
from kombu import Message

from workers.batching.job import Job, SummaryRequest


def _job(settled: list, job_id: str = "job-1") -> Job:
    app = Celery("t", set_as_current=False)

    @app.task(name="iq.infer.t", acks_late=True, shared=False)
    def t(**_kw):
        return None

    headers = {"id": job_id, "task": "iq.infer.t", "argsrepr": "()", "kwargsrepr": "{...}",
               "timelimit": [None, None], "eta": None, "expires": None}
    body = ((), {"inputs": ["x"]}, {})
    message = Message(body=b"", headers=headers, delivery_tag=f"tag-{job_id}",
                      properties={"priority": 5}, content_type="application/json")

    def make(job: Job) -> SummaryRequest:
        return SummaryRequest(message, on_ack=lambda *_a: settled.append(("ack", job.id)),
                              on_reject=lambda *_a: settled.append(("reject", job.id)),
                              body=body, headers=headers, decoded=True, task=t, app=app,
                              hostname="w@test", eventer=job.eventer)

    return Job(message, headers, body, t, None, make,
               lambda m, requeue: settled.append(("settle", m.delivery_tag, requeue)))


def test_a_job_answers_a_batchs_reads_without_a_request():
    settled: list = []
    before = SummaryRequest.built
    job = _job(settled)
    assert Job.light(job.headers)
    assert (job.id, job.name, job.kwargs) == ("job-1", "iq.infer.t", {"inputs": ["x"]})
    assert job.delivery_info == {"priority": 5} and job.kwargsrepr == "{...}"
    assert not job.revoked() and job.expires is None
    job.acknowledge()
    job.acknowledge()
    assert settled == [("settle", "tag-job-1", False)]  # once, as Request.acknowledge
    assert job.acknowledged and SummaryRequest.built == before


def test_what_only_a_request_answers_builds_it_once_with_what_celery_set_on_the_job():
    job = _job([])
    before = SummaryRequest.built
    worker_state.task_reserved(job)
    try:
        job.worker_pid, job.time_start = 42, 1000.0
        job.eventer = "the reconnect's eventer"  # as Celery's events step sets it
        info = job.info()
        assert SummaryRequest.built == before + 1
        assert (info["worker_pid"], info["time_start"], info["kwargs"]) == (42, 1000.0, "{...}")
        assert job.request.eventer == "the reconnect's eventer"
        job.info()
        assert SummaryRequest.built == before + 1  # built once
    finally:
        worker_state.task_ready(job)


def test_celerys_own_handling_of_the_request_takes_the_job_off_the_books():
    settled: list = []
    job = _job(settled, "job-revoked")
    worker_state.task_reserved(job)
    worker_state.task_accepted(job)
    worker_state.revoked.add(job.id)
    try:
        assert job.revoked()  # Celery's: announced, acknowledged, task_ready
        assert job not in worker_state.reserved_requests
        assert job not in worker_state.active_requests
        assert job.id not in worker_state.requests
        assert ("ack", "job-revoked") in settled
    finally:
        worker_state.revoked.discard(job.id)
        worker_state.task_ready(job)
