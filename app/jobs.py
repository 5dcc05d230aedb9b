"""/v1/jobs: submit a job, read it back (optionally waiting for it to finish), cancel it. The
views read the request, call the store or the submitter (app/submission.py) and write the
answer."""
from __future__ import annotations

import json
import time
from contextlib import ExitStack
from typing import Any

from flask import Response, current_app, g, jsonify, request
from marshmallow import Schema, fields, validate
from werkzeug.wsgi import LimitedStream

from app import auth, uploads
from app.docs import UPLOAD_QUERY, Blueprint, Error, Job, JobAccepted, job_request_body
from app.errors import (Conflict, MalformedRequest, NotFound, PayloadTooLarge, TooManyWaits,
                        UnsupportedMediaType, ValidationFailed)
from app.store import WaitRefused, new_job_id, parse_job_id
from app.submission import Accepted, Caller
from app.waiter import NoSlot
from config import Settings
from config.models import ModelSpec
from tasks.jobstate import CancelOutcome, JobRecord, Status, iso


def _ext(name: str):
    return current_app.extensions[name]


def _read_whole_body() -> None:
    """Read the body (kept for the parsers), refusing one over max_body_bytes. werkzeug ends
    a body sent without Content-Length (chunked) at the limit without a word, so one byte
    past it is asked of the server: any there means the body was larger."""
    request.get_data(cache=True)
    stream = request.stream
    if isinstance(stream, LimitedStream) and stream.is_exhausted \
            and request.environ["wsgi.input"].read(1):
        raise PayloadTooLarge("request body is larger than the configured limit")


def _request_body() -> object:
    _read_whole_body()
    if request.args and not request.mimetype.startswith("image/"):
        # Only an image/* body takes its job from the query; anywhere else a query parameter
        # would be silently ignored, so it is refused.
        raise ValidationFailed("the job is invalid", fields={
            name: ["query parameters are for image/* bodies only; put it in the job"]
            for name in request.args})
    if not request.is_json:
        upload = uploads.job_from_upload(request)  # images as multipart or an image/* body
        if upload is not None:
            return upload
        raise UnsupportedMediaType("send the job as JSON (Content-Type: application/json), "
                                   "or images as multipart/form-data or an image/* body")
    try:
        return json.loads(request.get_data())
    except (ValueError, RecursionError) as exc:  # bad UTF-8 is a ValueError too
        raise MalformedRequest(f"request body is not valid JSON: {exc}") from None


def _preferred_wait(max_wait_s: float) -> float | None:
    """RFC 7240 `Prefer: wait=N`: hold the POST up to N seconds (at most max_wait_s) for the
    job to finish, and answer with the finished job; past that, the usual 202. One request
    per job instead of two for a client that wants the result now. As the RFC asks, a
    preference that cannot be understood is ignored rather than refused."""
    for preference in request.headers.get("Prefer", "").split(","):
        name, _, value = preference.split(";", 1)[0].strip().partition("=")
        if name.strip().lower() != "wait":
            continue
        try:
            seconds = float(value.strip().strip('"'))
        except ValueError:
            return None
        return min(seconds, max_wait_s) if seconds > 0 else None  # NaN is not > 0
    return None


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    response = jsonify(body)
    response.status_code = status
    response.headers.update(headers or {})
    return response


def _accepted(accepted: Accepted, finished: JobRecord | None = None,
              wait: float | None = None) -> Response:
    """202 with the job's URL; or 201 with the job when it `finished` within a `Prefer: wait`.
    `wait`: the wait applied (None: none was asked, or no wait slot was free)."""
    job, url = accepted.job, f"/v1/jobs/{accepted.job.id}"
    headers = {"Location": url}
    if wait is not None:
        headers["Preference-Applied"] = f"wait={wait:g}"
    if finished is not None and finished.terminal:
        return _json({**job_body(finished), "url": url}, 201, headers)
    return _json({"id": job.id, "status": job.status.value, "model": accepted.spec.name,
                  "created_at": iso(job.created_at), "url": url,
                  "trace_id": job.trace_id or g.trace_id}, 202, headers)


def _submit_and_wait(caller: Caller, wait: float) -> Response:
    """`Prefer: wait`: the job submitted under a watch started before it exists, so the wait
    needs no read until the job's finish is announced. With every wait slot taken the job is
    still submitted, and answered 202 at once."""
    store, submitter = _ext("iq.store"), _ext("iq.submitter")
    deadline = time.monotonic() + wait
    job_id = new_job_id()
    finished: JobRecord | None = None
    with ExitStack() as watching:
        try:
            watch = watching.enter_context(store.watch(job_id, caller.owner))
        except NoSlot:
            watch = None
        accepted = submitter.submit(caller, _request_body, job_id=job_id)
        if watch is not None and accepted.created:
            finished = watch.until_terminal(accepted.job, deadline)
    if watch is not None and not accepted.created:  # an earlier job of its Idempotency-Key
        try:
            finished = store.wait(accepted.job.id, max(deadline - time.monotonic(), 0.001),
                                  caller.owner)
        except WaitRefused:
            watch = None
    return _accepted(accepted, finished, wait if watch is not None else None)


def blueprint(settings: Settings, models: dict[str, ModelSpec]) -> Blueprint:
    """The /v1/jobs routes of one app: the `wait` bound comes from its settings."""
    bp = Blueprint("jobs", __name__, url_prefix="/v1",
                   description="Submit jobs, read them back (waiting for them if asked), "
                               "cancel them")
    max_wait_s = settings.max_wait_s
    uploads_ = any(s.input_type == "image" for s in models.values())

    @bp.post("/jobs")
    @bp.doc(summary="Submit a job", requestBody=job_request_body(models), parameters=[
        {"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"}},
        {"name": "Prefer", "in": "header", "schema": {"type": "string"},
         "description": f"wait=S (at most {max_wait_s:g}): answer 201 with the finished job "
                        "if it is done within S seconds (RFC 7240)"},
        *(UPLOAD_QUERY if uploads_ else [])])
    @bp.response(202, JobAccepted, description="accepted")
    @bp.alt_response(201, schema=Job, description="finished within Prefer: wait")
    @bp.alt_response(400, schema=Error, description="malformed JSON")
    @bp.alt_response(409, schema=Error, description="Idempotency-Key reused")
    @bp.alt_response(413, schema=Error, description="body too large")
    @bp.alt_response(415, schema=Error, description="not JSON nor an image upload")
    @bp.alt_response(422, schema=Error, description="invalid job: `fields` names each field")
    @bp.alt_response(429, schema=Error, description="queue full or rate limited")
    @bp.alt_response(503, schema=Error, description="Redis unreachable")
    def submit_job():
        caller = Caller(auth.current_key(), g.trace_id, request.headers.get("Idempotency-Key"))
        wait = _preferred_wait(max_wait_s)
        if wait is not None:
            return _submit_and_wait(caller, wait)
        return _accepted(_ext("iq.submitter").submit(caller, _request_body))

    @bp.get("/jobs/<job_id>")
    @bp.arguments(_wait_args(max_wait_s), location="query", as_kwargs=True)
    @bp.response(200, Job, description="the job")
    @bp.alt_response(404, schema=Error, description="no such job")
    @bp.alt_response(429, schema=Error, description="every wait slot is taken")
    @bp.alt_response(503, schema=Error, description="Redis unreachable")
    def get_job(job_id: str, wait: float | None = None):
        return _json(job_body(_read_job(job_id, wait)))

    @bp.delete("/jobs/<job_id>")
    @bp.response(200, Job, description="cancelled")
    @bp.alt_response(404, schema=Error, description="no such job")
    @bp.alt_response(409, schema=Error, description="already running or finished")
    def cancel_job(job_id: str):
        """Cancel a queued job: it ends `cancelled` and never runs. A job already running or
        finished answers 409 with its status."""
        return _json(job_body(_cancel_job(job_id)))

    return bp


def _wait_args(max_wait_s: float) -> type[Schema]:
    class WaitArgs(Schema):
        wait = fields.Float(
            allow_nan=False, validate=validate.Range(min=0, max=max_wait_s, min_inclusive=False),
            metadata={"description": "hold the request until the job is terminal or this many "
                                     "seconds pass; 429 when every wait slot is taken"})

    return WaitArgs


def _not_found(job_id: str) -> NotFound:
    return NotFound(f"no job {job_id!r} (never submitted, or its record expired)")


def _read_job(job_id: str, wait: float | None) -> JobRecord:
    """The caller's job, once terminal or after `wait` seconds if a wait is asked."""
    canonical = parse_job_id(job_id)
    store, owner = _ext("iq.store"), auth.current_owner()
    job = None
    if canonical is not None and wait is None:
        job = store.get(canonical, owner)
    elif canonical is not None:
        try:
            job = store.wait(canonical, wait, owner)
        except WaitRefused as refused:
            raise TooManyWaits(f"{refused}; read the job without ?wait or retry later",
                               retry_after=1, status=refused.job.status.value) from None
    if job is None:
        raise _not_found(job_id)
    return job


def _cancel_job(job_id: str) -> JobRecord:
    """The caller's job, cancelled now; 404 or 409 (with its status) when it cannot be."""
    canonical = parse_job_id(job_id)
    store = _ext("iq.store")
    owned = canonical is not None and store.owned_by(canonical, auth.current_owner())
    outcome = store.cancel(canonical) if owned else CancelOutcome.MISSING
    if outcome is CancelOutcome.MISSING:
        raise _not_found(job_id)
    job = store.get(canonical)
    if outcome is not CancelOutcome.CANCELLED or job is None \
            or job.status is not Status.CANCELLED:
        status = job.status.value if job else "unknown"
        raise Conflict(f"the job is {status} and can no longer be cancelled",
                       headers={"X-Job-Status": status}, status=status)
    return job


def job_body(job: JobRecord) -> dict[str, Any]:
    """A job as GET /v1/jobs/<id> shows it."""
    body: dict[str, Any] = {
        "id": job.id,
        "model": job.model,
        "status": job.status.value,
        "created_at": iso(job.created_at),
        "started_at": iso(job.started_at) if job.started_at else None,
        "finished_at": iso(job.finished_at) if job.finished_at and job.terminal else None,
    }
    if job.trace_id:
        body["trace_id"] = job.trace_id
    # How the outputs travel, so that any reader (not only the submitter) can decode them.
    body["encoding_format"] = job.encoding_format
    if job.batch is not None:
        body["batch"] = job.batch
    if job.model_version:
        body["model_version"] = job.model_version
    if job.status is Status.SUCCEEDED:
        # Outputs are kept result_ttl_s, the record job_ttl_s: past the first, say so.
        body["result"] = {"outputs": job.outputs} if job.outputs is not None else None
        if job.outputs is None:
            body["result_expired"] = True
    elif job.error is not None:
        body["error"] = job.error.to_dict()
    return body
