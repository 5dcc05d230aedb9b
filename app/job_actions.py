"""/v1/jobs/<id>: the moves on one job of the caller's. Cancel (`POST .../cancel`, as hosted
inference APIs do it): a queued job ends `cancelled` and never runs. Retry (`POST .../retry`):
a job that failed, was cancelled or expired runs again as a new job with the request it kept
(inputs, options), the two linked both ways. Delete (`DELETE`): a finished job is gone, with
its result and kept request; a job still queued or running is cancelled first, not deleted."""
from __future__ import annotations

from flask import current_app, g

from app import auth
from app.openapi import LOCATION, REQUEST_ID, Blueprint, errors, job_links
from app.errors import Conflict, job_is
from app.jobs import accepted, caller_job, not_found, on_job
from app.responses import Job, answer, job_body, no_content
from app.store import DEAD_STATUSES
from app.submission import Caller
from tasks.jobstate import CancelOutcome, JobRecord, RetryRefused, Status


def _ext(name: str):
    return current_app.extensions[name]


def register(bp: Blueprint, keys: bool) -> None:
    """Add the routes to the jobs blueprint (`keys`: whether API keys are configured)."""

    @bp.post("/jobs/<job_id>/cancel")
    @bp.doc(summary="Cancel a queued job", operationId="cancelJob")
    @bp.response(200, Job, description="cancelled: it never runs",
                 headers={"X-Request-ID": REQUEST_ID})
    @errors(bp, keys, e404=None, e409="running or finished already (`status` says which)")
    def cancel_job(job_id: str):
        """A queued job ends `cancelled` and never runs. A job already running or finished
        answers 409 with its status."""
        return answer(Job, job_body(_cancel(job_id)))

    @bp.post("/jobs/<job_id>/retry")
    @bp.doc(summary="Retry a job that failed, was cancelled or expired",
            operationId="retryJob", responses={202: {"links": job_links()}})
    @bp.response(202, Job, description="the new job, as queued (`retry_of` names this one)",
                 headers={"Location": LOCATION, "X-Request-ID": REQUEST_ID})
    @errors(bp, keys, e403=None, e404=None, e409="it succeeded or is not finished, was "
            "retried already (`retried_as`), or its request is no longer kept", e422=None,
            e429="the model's queue is full, the key's rate limit or read budget is used up, "
                 "or its kept requests are at its quota (kept_full)")
    def retry_job(job_id: str):
        """A new job with the model, inputs and options of this one, which must have failed,
        been cancelled or expired, and not been retried yet; its request is kept
        IQ_KEPT_INPUTS_TTL_S after it ended. The two are linked: `retry_of` on the new one,
        `retried_as` on this one."""
        return accepted(_retry(job_id))

    @bp.delete("/jobs/<job_id>")
    @bp.doc(summary="Delete a finished job", operationId="deleteJob")
    @bp.response(204, description="deleted: the job, its result and its kept request",
                 headers={"X-Request-ID": REQUEST_ID})
    @errors(bp, keys, e404=None, e409="queued (cancel it first) or running (delete it once it "
                                      "finishes)")
    def delete_job(job_id: str):
        """A finished job (any final status) is deleted: its record, result and kept request;
        its id then answers 404. A job still queued is 409: cancel it first; a running one is
        409 too, and can be deleted once it finishes (a running job cannot be cancelled)."""
        with on_job(job_id) as (canonical, store):
            done = store.delete(canonical, auth.current_owner())
        if done == "missing":
            raise not_found(job_id)
        if done != "deleted":
            then = f"cancel it first (POST /v1/jobs/{canonical}/cancel)" if done == "queued" \
                else "delete it once it finishes (a running job cannot be cancelled)"
            raise Conflict(f"{job_is(done)}: {then}", status=done)
        return no_content()


def _cancel(job_id: str) -> JobRecord:
    """The caller's job, cancelled now; 404 or 409 (with its status) when it cannot be."""
    with on_job(job_id) as (canonical, store):
        owned = store.owned_by(canonical, auth.current_owner())
        outcome = store.cancel(canonical) if owned else CancelOutcome.MISSING
        if outcome is CancelOutcome.MISSING:
            raise not_found(job_id)
        job = store.get(canonical)
    if outcome is not CancelOutcome.CANCELLED or job is None \
            or job.status is not Status.CANCELLED:
        status = job.status.value if job else "unknown"
        raise Conflict(f"{job_is(status)} and can no longer be cancelled",
                       headers={"X-Job-Status": status}, status=status)
    return job


def _retry(job_id: str) -> JobRecord:
    """The new job retrying the caller's job `job_id`; 404 or 409 when it cannot be."""
    canonical, job, store = caller_job(job_id)
    if job.retried_as:
        raise _retried(job, job.retried_as)
    if job.status.value not in DEAD_STATUSES:
        raise Conflict(f"{job_is(job.status.value)}: only a job that failed, was cancelled or "
                       "expired can be retried", status=job.status.value)
    with store.answering():
        request = store.kept_request(canonical)
    if request is None:
        raise Conflict(_not_kept(job), status=job.status.value)
    caller = Caller(auth.current_key(), g.trace_id)
    try:
        return _ext("iq.submitter").retry(caller, job, request).job
    except RetryRefused as refused:
        if refused.reason == "missing":
            raise not_found(job_id) from None
        if refused.reason == "retried":
            raise _retried(job, refused.job_id) from None
        raise Conflict(f"{job_is(refused.reason)}: only a job that failed, was cancelled or "
                       "expired can be retried", status=refused.reason) from None


def _retried(job: JobRecord, retried_as: str) -> Conflict:
    return Conflict(f"the job was retried already, as {retried_as}",
                    status=job.status.value, retried_as=retried_as)


def _not_kept(job: JobRecord) -> str:
    settings = _ext("iq.submitter").settings
    if job.kept:
        return (f"its request is no longer kept: requests are kept IQ_KEPT_INPUTS_TTL_S "
                f"({settings.kept_s} s) after a job ends")
    return ("its request was not kept: it was larger than IQ_KEPT_INPUTS_MAX_BYTES "
            f"({settings.kept_inputs_max_bytes} bytes as JSON), or retries were off "
            "(IQ_KEPT_INPUTS_TTL_S=0) when it was submitted")
