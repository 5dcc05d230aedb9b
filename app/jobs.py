"""/v1/jobs: submit a job, read it back (optionally waiting for it to finish), list the caller's
jobs. The same blueprint carries the moves on one job (app/job_actions.py: cancel, retry,
delete) and its event stream (app/events.py). The views read the request, call the store or
the submitter (app/submission.py) and answer through the schema that documents the answer
(app/responses.py)."""
from __future__ import annotations

import json
import re
import time
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Callable, Iterator
from urllib.parse import urlencode

import orjson
from flask import Request, Response, current_app, g, request
from marshmallow import Schema, fields, validate
from werkzeug.wsgi import LimitedStream

from app import auth
from app import uploads as uploads_
from app.openapi import (IDEMPOTENCY_KEY, LOCATION, PREFERENCE_APPLIED, REQUEST_ID,
                         X_REQUEST_ID, Blueprint, errors, job_links, job_request_body)
from app.errors import (MalformedRequest, NotFound, PayloadTooLarge, TooManyUploads,
                        TooManyWaits, UnsupportedMediaType, ValidationFailed, json_problem)
from app.limits import NoUpload, Uploads
from app.responses import STATUSES, Job, JobList, answer, job_body, job_url
from app.store import JobStore, WaitRefused, Watch
from app.submission import Accepted, Caller
from app.waiter import NoSlot
from config import Settings
from config.models import ModelSpec
from tasks.jobstate import JobRecord

CURSOR = r"^[0-9]{1,16}:[0-9a-f-]{36}$"


def _ext(name: str):
    return current_app.extensions[name]


def _read_whole_body(served: Request, uploads: Uploads, owner: str) -> None:
    """Read the body (kept for the parsers), refusing one over max_body_bytes, within one of
    the `owner`'s upload slots (app/limits.py: 429 at once when it holds them all). werkzeug
    ends a body sent without Content-Length (chunked) at the limit without a word, so one byte
    past it is asked of the server: any there means the body was larger."""
    try:
        with uploads.hold(owner or None):
            served.get_data(cache=True)
            stream = served.stream
            if isinstance(stream, LimitedStream) and stream.is_exhausted \
                    and served.environ["wsgi.input"].read(1):
                raise PayloadTooLarge("request body is larger than the configured limit")
    except NoUpload as exc:
        raise TooManyUploads(f"{exc}; send it once one of them has arrived") from None


def _request_body(served: Request, uploads: Uploads, owner: str) -> object:
    """The job `served` carries (as JSON, or images), read as `_read_whole_body` says."""
    _read_whole_body(served, uploads, owner)
    # Only a request with a query string has query parameters to look at (werkzeug parses
    # one into its `args` at first sight: ~13 calls a request without one).
    if served.query_string and served.args and not served.mimetype.startswith("image/"):
        # Only an image/* body takes its job from the query; anywhere else a query parameter
        # would be silently ignored, so it is refused.
        raise ValidationFailed("the job is invalid", fields={
            name: ["query parameters are for image/* bodies only; put it in the job"]
            for name in served.args})
    if not _is_json(served):
        upload = uploads_.job_from_upload(served)  # images as multipart or an image/* body
        if upload is not None:
            return upload
        raise UnsupportedMediaType("send the job as JSON (Content-Type: application/json), "
                                   "or images as multipart/form-data or an image/* body")
    try:
        return read_json(served.get_data())
    except (ValueError, RecursionError) as exc:  # bad UTF-8 is a ValueError too
        raise MalformedRequest(f"request body is not valid JSON: {json_problem(exc)}") from None


# A run of 19 digits or more: an integer orjson would read as a float (past 64 bits), where
# Python's json reads it whole; or a number long enough to be worth the general reader.
_LONG_NUMBER = re.compile(rb"\d{19}")
# Brackets a body orjson reads may hold, in all: fewer than this, its nesting is far within
# both readers' limits (json's is Python's recursion limit less the request's own frames;
# orjson's 1,024), so that neither refuses what the other reads.
_BRACKETS = 500


def read_json(body: bytes) -> object:
    """`json.loads(body)`, read by orjson (a few calls, not json's ~15) whenever orjson reads
    it as json does: strict JSON in UTF-8, with no number of 19 digits or more, and fewer
    than _BRACKETS brackets. Anything else, and whatever orjson refuses (NaN, a lone
    surrogate, a byte-order mark, UTF-16, bad JSON), json reads: its value or its error
    (naming where the body went wrong) is the answer, as it always was."""
    if body.count(b"[") + body.count(b"{") < _BRACKETS and not _LONG_NUMBER.search(body):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


# Header values seen and what each says, read once a process for the first MEMO_MOST values
# (a client sends the same few again and again; one that sends a new value each time has it
# read each time): whether a Content-Type is JSON's (werkzeug's own `is_json`), the wait a
# Prefer header asks for (`_asked_wait`).
MEMO_MOST = 256
_JSON_TYPES: dict[str, bool] = {}
_WAITS: dict[str, float | None] = {}


def _is_json(served: Request) -> bool:
    """`served.is_json`: werkzeug's answer for its Content-Type, parsed once a process."""
    content_type = served.environ.get("CONTENT_TYPE", "")  # what its headers' Content-Type is
    found = _JSON_TYPES.get(content_type)
    if found is None:
        found = served.is_json
        if len(_JSON_TYPES) < MEMO_MOST:
            _JSON_TYPES[content_type] = found
    return found


def _preferred_wait(served: Request, max_wait_s: float) -> float | None:
    """RFC 7240 `Prefer: wait=N`: hold the POST up to N seconds (at most max_wait_s) for the
    job to finish, and answer with the finished job; past that, the usual 202. One request
    per job instead of two for a client that wants the result now. As the RFC asks, a
    preference that cannot be understood is ignored rather than refused."""
    header = served.environ.get("HTTP_PREFER", "")  # its headers' Prefer (all of them, joined)
    seconds = _WAITS.get(header, -1.0)
    if seconds == -1.0:
        seconds = _asked_wait(header)
        if len(_WAITS) < MEMO_MOST:
            _WAITS[header] = seconds
    return None if seconds is None else min(seconds, max_wait_s)


def _asked_wait(header: str) -> float | None:
    """The seconds a Prefer header's `wait` asks for; None when it asks for none, or for one
    that cannot be read or is not above 0."""
    for preference in header.split(","):
        name, _, value = preference.split(";", 1)[0].strip().partition("=")
        if name.strip().lower() != "wait":
            continue
        try:
            seconds = float(value.strip().strip('"'))
        except ValueError:
            return None
        return seconds if seconds > 0 else None  # NaN is not > 0
    return None


def accepted(job: JobRecord, finished: JobRecord | None = None,
             wait: float | None = None) -> Response:
    """202 with the job as it was queued; or 201 with the job when it `finished` within a
    `Prefer: wait`. `wait`: the wait applied (None: none was asked, or no slot was free)."""
    headers = {"Location": job_url(job.id)}
    if wait is not None:
        headers["Preference-Applied"] = f"wait={wait:g}"
    if finished is not None and finished.terminal:
        return answer(Job, job_body(finished), 201, headers, dumped=True)
    return answer(Job, job_body(job), 202, headers, dumped=True)


def _submit_and_wait(extensions: dict, caller: Caller, read_body: Callable[[], object],
                     wait: float) -> Response:
    """`Prefer: wait`: the job submitted under a watch started before it exists (once the
    request is checked and the job has its id), so the wait needs no read until the job's
    finish is announced. With every wait slot taken the job is still submitted, and answered
    202 at once."""
    stores, submitter = extensions["iq.store"], extensions["iq.submitter"]
    deadline = time.monotonic() + wait
    finished: JobRecord | None = None
    watch: Watch | None = None
    with ExitStack() as watching:
        def watch_first(job_id: str) -> str:  # its id says its Redis: known once validated
            nonlocal watch
            store = (stores.for_job(job_id) or ("", stores.default))[1]
            try:
                watch = watching.enter_context(store.watch(job_id, caller.owner))
            except NoSlot:
                return ""
            return watch.reply  # its finish brings the job to this watch: no read after it

        done: Accepted = submitter.submit(caller, read_body, before_queue=watch_first)
        if watch is not None and done.created:
            finished = watch.until_terminal(done.job, deadline)
    if watch is not None and not done.created:  # an earlier job of its Idempotency-Key
        found = stores.for_job(done.job.id)
        try:
            if found is not None:
                with found[1].answering():
                    finished = found[1].wait(found[0], max(deadline - time.monotonic(),
                                                           0.001), caller.owner)
        except WaitRefused:
            watch = None
    return accepted(done.job, finished, wait if watch is not None else None)


def blueprint(settings: Settings, models: dict[str, ModelSpec], keys: bool) -> Blueprint:
    """The /v1/jobs routes of one app that submit, read and list (app/job_actions.py and
    app/events.py add theirs): the `wait` bound comes from its settings, the documented
    answers and security from whether API keys are configured (`keys`)."""
    bp = Blueprint("jobs", __name__, url_prefix="/v1",
                   description="Submit jobs, list them, read them back (waiting for them or "
                               "following their events if asked), cancel, retry, delete them")
    _submit_route(bp, settings, models, keys)
    _read_routes(bp, settings, models, keys)
    return bp


_JOB_HEADERS = {"Location": LOCATION, "X-Request-ID": REQUEST_ID,
                "Preference-Applied": PREFERENCE_APPLIED}


def _submit_route(bp: Blueprint, settings: Settings, models: dict[str, ModelSpec],
                  keys: bool) -> None:
    max_wait_s = settings.max_wait_s
    links = {"links": job_links()}

    @bp.post("/jobs")
    @bp.doc(summary="Submit a job", operationId="submitJob",
            requestBody=job_request_body(models),
            parameters=[IDEMPOTENCY_KEY, X_REQUEST_ID, {
                "name": "Prefer", "in": "header", "schema": {"type": "string"},
                "description": f"wait=S (RFC 7240; at most {max_wait_s:g} is applied): answer "
                               "201 with the finished job if it is done within S seconds. A "
                               "preference the API cannot read is ignored"}],
            responses={202: links, 201: links})
    @bp.response(202, Job, description="accepted: the job as queued", headers=_JOB_HEADERS)
    @bp.alt_response(201, schema=Job, description="finished within Prefer: wait",
                     headers=_JOB_HEADERS, success=True)
    @errors(bp, keys, e400=None, e403=None, e409="Idempotency-Key reused with another body",
            e413=None, e415=None, e422=None,
            e429="the model's queue is full, the key's rate limit is used up, its kept "
                 "requests are at its quota (kept_full), or it is sending as many bodies as "
                 "it may (too_many_uploads)")
    def submit_job():
        # The request, `g` and the app's extensions looked up once (each a context-local
        # look-up through werkzeug's proxies), not by each function the submit goes through.
        served, values = request._get_current_object(), g._get_current_object()
        extensions = current_app.extensions
        # Its Idempotency-Key header as werkzeug's headers read it, without their look-up.
        caller = Caller(values.get("api_key"), values.trace_id,
                        served.environ.get("HTTP_IDEMPOTENCY_KEY"))
        read_body = partial(_request_body, served, extensions["iq.uploads"], caller.owner)
        wait = _preferred_wait(served, max_wait_s)
        if wait is not None:
            return _submit_and_wait(extensions, caller, read_body, wait)
        return accepted(extensions["iq.submitter"].submit(caller, read_body).job)


def _read_routes(bp: Blueprint, settings: Settings, models: dict[str, ModelSpec],
                 keys: bool) -> None:
    @bp.get("/jobs/<job_id>")
    @bp.doc(summary="Read a job", operationId="getJob")
    @bp.arguments(_wait_args(settings.max_wait_s), location="query", as_kwargs=True)
    @bp.response(200, Job, description="the job", headers={"X-Request-ID": REQUEST_ID})
    @errors(bp, keys, e404=None, e429="every wait slot is taken (too_many_waits), or the "
            "key's read budget is used up (rate_limited)")
    def get_job(job_id: str, wait: float | None = None):
        return answer(Job, job_body(_read_job(job_id, wait)), dumped=True)

    @bp.get("/jobs")
    @bp.doc(summary="List your jobs, newest first", operationId="listJobs")
    @bp.arguments(_list_args(models), location="query", as_kwargs=True)
    @bp.response(200, JobList, description="a page of jobs",
                 headers={"X-Request-ID": REQUEST_ID})
    @errors(bp, keys, e422=None)
    def list_jobs(limit: int, status: str = "", model: str = "", cursor: str = ""):
        """The caller's jobs (its API key's; every job when keys are off), newest first,
        without their outputs. `status=failed` (or cancelled, expired) lists the dead-letter
        index: jobs that did not succeed, newest ending first. A page without a filter reads
        `limit` jobs; one with any filter at most 500 jobs (and costs that from the key's read
        budget): a page may hold fewer than `limit` jobs and still have a `next_cursor`. While
        a Redis group does not answer, the page holds the other groups' jobs and `unreachable`
        names it."""
        auth.charge_read(auth.current_key(), _ext("iq.store").scan_cost(
            status=status, model=model, limit=limit))
        after = tuple(cursor.split(":", 1)) if cursor else None
        page, unreachable = _ext("iq.store").page(auth.current_owner(), status=status,
                                                  model=model, cursor=after, limit=limit)
        following = ":".join(page.cursor) if page.cursor else None
        query = {k: v for k, v in (("status", status), ("model", model)) if v}
        query.update(limit=limit, cursor=following)
        body = {"jobs": [job_body(job, outputs=False) for job in page.jobs],
                "next_cursor": following,
                "next": f"/v1/jobs?{urlencode(query, safe=':')}" if following else None}
        if unreachable:
            body["unreachable"] = unreachable
        return answer(JobList, body)


def _wait_args(max_wait_s: float) -> type[Schema]:
    class WaitArgs(Schema):
        wait = fields.Float(
            allow_nan=False, validate=validate.Range(min=0, max=max_wait_s, min_inclusive=False),
            metadata={"description": "hold the request until the job is terminal or this many "
                                     "seconds pass; 429 when every wait slot is taken"})

    return WaitArgs


def _list_args(models: dict[str, ModelSpec]) -> type[Schema]:
    class ListArgs(Schema):
        status = fields.String(validate=validate.OneOf(STATUSES))
        model = fields.String(validate=validate.OneOf(sorted(models)))
        limit = fields.Integer(load_default=20, validate=validate.Range(min=1, max=100),
                               metadata={"description": "jobs a page holds at most"})
        cursor = fields.String(validate=validate.Regexp(CURSOR), metadata={
            "description": "the `next_cursor` of the page before"})

    return ListArgs


def not_found(job_id: str) -> NotFound:
    return NotFound(f"no job {job_id!r} (never submitted, or its record expired)")


@contextmanager
def on_job(job_id: str) -> Iterator[tuple[str, JobStore]]:
    """The canonical id of `job_id` and the job store of the Redis group it names
    (app/group_stores.py), the block's calls on it answered, when that group's Redis fails,
    as a 503 naming the group (JobStore.answering); 404 for an id we cannot have issued."""
    found = _ext("iq.store").for_job(job_id)
    if found is None:
        raise not_found(job_id)
    with found[1].answering():
        yield found


def caller_job(job_id: str) -> tuple[str, JobRecord, JobStore]:
    """The canonical id, the caller's job of that id (or 404) and the store it lives in."""
    with on_job(job_id) as (canonical, store):
        job = store.get(canonical, auth.current_owner())
    if job is None:
        raise not_found(job_id)
    return canonical, job, store


def _read_job(job_id: str, wait: float | None) -> JobRecord:
    """The caller's job, once terminal or after `wait` seconds if a wait is asked."""
    owner = auth.current_owner()
    with on_job(job_id) as (canonical, store):
        if wait is None:
            job = store.get(canonical, owner)
        else:
            try:
                job = store.wait(canonical, wait, owner)
            except WaitRefused as refused:
                raise TooManyWaits(f"{refused}; read the job without ?wait or retry later",
                                   retry_after=1, status=refused.job.status.value) from None
    if job is None:
        raise not_found(job_id)
    return job
