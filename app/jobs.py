"""/v1/jobs: submit a job, read it back (optionally waiting for it to finish)."""
from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from flask import Blueprint, current_app, g, jsonify, request
from marshmallow import ValidationError

from app import auth, images, uploads
from app.errors import (Conflict, MalformedRequest, NotFound, TooManyJobs, Unavailable,
                        UnsupportedMediaType, ValidationFailed)
from app.schemas import flatten, validate_job
from app.store import parse_job_id
from tasks import egress, tracing, webhooks
from tasks.jobstate import IdempotencyMismatch, JobRecord, Overloaded, Status, StoreFull
from tasks.logs import trace_id_var

bp = Blueprint("jobs", __name__, url_prefix="/v1")
logger = logging.getLogger(__name__)

_TRACE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


def _ext(name: str):
    return current_app.extensions[name]


def _settings():
    return current_app.config["IQ_SETTINGS"]


def _json_body() -> object:
    if not request.is_json:
        upload = uploads.job_from_upload(request)  # images as multipart or an image/* body
        if upload is not None:
            return upload
        raise UnsupportedMediaType("send the job as JSON (Content-Type: application/json), "
                                   "or images as multipart/form-data or an image/* body")
    try:
        return json.loads(request.get_data(cache=False))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 is a ValueError too
        raise MalformedRequest(f"request body is not valid JSON: {exc}") from None


@bp.before_app_request
def _trace_id() -> None:
    given = request.headers.get("X-Request-ID", "")
    # With OpenTelemetry on, the job's trace id is its trace's (a caller's `traceparent`
    # decides it); otherwise the caller's X-Request-ID, or a fresh one of the same shape.
    g.trace_id = tracing.current_trace_id() or (
        given if _TRACE_ID.match(given) else uuid.uuid4().hex)
    # Every log line of this request carries it; reset when the request ends.
    g.trace_token = trace_id_var.set(g.trace_id)


@bp.teardown_app_request
def _end_trace(_exc: BaseException | None) -> None:
    token = g.pop("trace_token", None)
    if token is not None:
        trace_id_var.reset(token)


@bp.after_app_request
def _echo_trace_id(response):
    if "trace_id" in g:
        response.headers["X-Request-ID"] = g.trace_id
    return response


@bp.post("/jobs")
def submit_job():
    metrics = _ext("iq.metrics")
    data = _json_body()
    try:
        spec, job = validate_job(data, _ext("iq.models"), _ext("iq.schemas"))
    except ValidationError as exc:
        model = data.get("model") if isinstance(data, dict) else None
        metrics.rejected.labels(str(model)[:64] if model in _ext("iq.models") else "unknown",
                                "validation").inc()
        raise ValidationFailed("the job is invalid", fields=flatten(exc.messages)) from None
    auth.check_model(spec.name)
    if job.get("webhook"):
        _check_webhook(job["webhook"])
    try:
        auth.check_rate(_ext("iq.store").redis)
    except auth.RateLimited:
        metrics.rejected.labels(spec.name, "rate_limited").inc()
        raise
    key = request.headers.get("Idempotency-Key")
    if key is not None and not _IDEMPOTENCY_KEY.match(key):
        raise ValidationFailed("invalid header", fields={
            "Idempotency-Key": ["1 to 255 visible ASCII characters"]})
    if spec.input_type == "image":  # decoded, checked and resized before it is queued
        try:
            job["inputs"] = images.canonical_inputs(spec, job["inputs"], _settings())
        except images.BadImages as exc:
            metrics.rejected.labels(spec.name, "validation").inc()
            raise ValidationFailed("the job is invalid", fields=exc.fields) from None
    try:
        submitted, created = _ext("iq.store").submit(spec, job, g.trace_id, key,
                                                     owner=auth.current_owner())
    except Overloaded:
        metrics.rejected.labels(spec.name, "queue_full").inc()
        raise TooManyJobs(f"the queue of {spec.name} is full "
                          f"({spec.max_queue_depth} jobs); retry later", retry_after=1) from None
    except IdempotencyMismatch:
        raise Conflict("this Idempotency-Key was used with a different request body") from None
    except StoreFull as exc:
        metrics.rejected.labels(spec.name, "store_full").inc()
        raise Unavailable(f"the job store is nearly full ({exc}); retry later",
                          retry_after=30) from None
    if created:
        metrics.submitted.labels(spec.name).inc()
        logger.info("job %s accepted: model=%s inputs=%d priority=%s", submitted.id,
                    spec.name, len(job["inputs"]), job["priority"])
    url = f"/v1/jobs/{submitted.id}"
    headers = {"Location": url}
    wait = _preferred_wait()
    if wait is not None:
        headers["Preference-Applied"] = f"wait={wait:g}"
        finished = _ext("iq.store").wait(submitted.id, wait, auth.current_owner())
        if finished is not None and finished.terminal:
            return jsonify({**job_body(finished), "url": url}), 201, headers
    body = {"id": submitted.id, "status": submitted.status.value, "model": spec.name,
            "created_at": submitted.fields.get("created_at"), "url": url,
            "trace_id": submitted.fields.get("trace_id", g.trace_id)}
    return jsonify(body), 202, headers


def _check_webhook(hook: dict) -> None:
    """422 for a webhook this service will not call. While webhooks are off (no secret) the
    answer is a 422 on `webhook`, not a 503: retrying will not help, and the job can be sent
    without the field and polled."""
    settings = _settings()
    if not webhooks.enabled(settings.webhook_secret):
        raise ValidationFailed("the job is invalid", fields={"webhook": [webhooks.SECRET_MISSING]})
    try:
        egress.check_url(hook["url"], allow=settings.webhook_allow_list)
    except egress.Refused as exc:
        raise ValidationFailed("the job is invalid", fields={"webhook.url": [str(exc)]}) from None


def _preferred_wait() -> float | None:
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
        return min(seconds, _settings().max_wait_s) if seconds > 0 else None
    return None


@bp.delete("/jobs/<job_id>")
def cancel_job(job_id: str):
    """Cancel a queued job: it ends `cancelled` and never runs. A job already running or
    finished answers 409 with its status."""
    canonical = parse_job_id(job_id)
    store = _ext("iq.store")
    owned = canonical is not None and store.owned_by(canonical, auth.current_owner())
    outcome = store.cancel(canonical) if owned else "missing"
    if outcome == "missing":
        raise NotFound(f"no job {job_id!r} (never submitted, or its record expired)")
    job = store.get(canonical)
    if outcome != "ok" or job is None or job.status is not Status.CANCELLED:
        status = job.status.value if job else "unknown"
        raise Conflict(f"the job is {status} and can no longer be cancelled",
                       headers={"X-Job-Status": status}, status=status)
    return jsonify(job_body(job))


@bp.get("/jobs/<job_id>")
def get_job(job_id: str):
    canonical = parse_job_id(job_id)
    wait = request.args.get("wait")
    if wait is not None:
        limit = current_app.config["IQ_SETTINGS"].max_wait_s
        try:
            seconds = float(wait)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds <= limit:
            raise ValidationFailed("invalid query parameter",
                                   fields={"wait": [f"must be a number in (0, {limit:g}]"]})
    store, owner = _ext("iq.store"), auth.current_owner()
    if canonical is None:
        job = None
    elif wait is not None:
        job = store.wait(canonical, seconds, owner)
    else:
        job = store.get(canonical, owner)
    if job is None:
        raise NotFound(f"no job {job_id!r} (never submitted, or its record expired)")
    return jsonify(job_body(job))


def job_body(job: JobRecord) -> dict[str, Any]:
    """A job as GET /v1/jobs/<id> shows it."""
    fields = job.fields
    body: dict[str, Any] = {
        "id": job.id,
        "model": fields.get("model"),
        "status": job.status.value,
        "created_at": fields.get("created_at"),
        "started_at": fields.get("started_at"),
        "finished_at": fields.get("finished_at") if job.terminal else None,
    }
    if fields.get("trace_id"):
        body["trace_id"] = fields["trace_id"]
    # How the outputs travel, so that any reader (not only the submitter) can decode them.
    body["encoding_format"] = fields.get("encoding_format") or "float"
    if fields.get("batch"):
        body["batch"] = json.loads(fields["batch"])
    if job.status is Status.SUCCEEDED:
        outputs = job.outputs
        # Outputs are kept result_ttl_s, the record job_ttl_s: past the first, say so.
        body["result"] = {"outputs": outputs} if outputs is not None else None
        if outputs is None:
            body["result_expired"] = True
    elif job.error is not None:
        body["error"] = {"code": job.error.code, "message": job.error.message}
    return body
