"""What the API answers, as marshmallow schemas, and the one place answers are written
(`answer`): every JSON body leaves dumped through the schema that documents it in
/openapi.json (app/openapi.py), so a field the schema does not name never leaves, and the two
cannot drift. Errors leave through `Error` the same way (app/errors.py)."""
from __future__ import annotations

from typing import Any, Mapping

from flask import Response, current_app, g
from marshmallow import Schema, fields, validate

from config.kinds import INPUT_TYPES
from tasks.errors import ErrorCode
from tasks.jobstate import JobRecord, Status, iso
from tasks.results import ENCODINGS

STATUSES = [s.value for s in Status]
_UUID = {"format": "uuid"}


class ErrorBody(Schema):
    code = fields.String(required=True)
    message = fields.String(required=True)
    at_fault = fields.Dict(keys=fields.String(), values=fields.List(fields.String()),
                           data_key="fields", attribute="fields",
                           metadata={"description": "the fields at fault, at most 30"})
    fields_omitted = fields.Integer(metadata={"description": "how many more fields were at "
                                                             "fault than `fields` lists"})
    status = fields.String(validate=validate.OneOf(STATUSES), metadata={
        "description": "the job's status, when it is why (409, too_many_waits)"})
    retried_as = fields.String(metadata={
        "description": "the job that already retries this one (409 to a retry)", **_UUID})
    job_id = fields.String(metadata={
        "description": "the job a submit refused with 503 may have recorded (Redis did not "
                       "answer in time, or no replica confirmed it): a resend with the same "
                       "Idempotency-Key returns it", **_UUID})


class Error(Schema):
    error = fields.Nested(ErrorBody, required=True)


class BatchInfo(Schema):
    id = fields.String(required=True)
    # Other jobs of the batch may be other tenants': with API keys their count is not shown.
    jobs = fields.Integer(metadata={"description": "jobs in that batch (API keys off only)"})
    items = fields.Integer(metadata={"description": "inputs in that batch (API keys off only)"})

    def get_attribute(self, obj: Any, attr: str, default: Any) -> Any:
        """A key or nothing: marshmallow's default falls back to attributes, and a dict
        without `items` has a method of that name."""
        return obj.get(attr, default)


class Progress(Schema):
    items_done = fields.Integer(required=True, validate=validate.Range(min=0))
    items = fields.Integer(required=True, validate=validate.Range(min=1))


class JobResult(Schema):
    outputs = fields.Raw(required=True, metadata={
        "type": "array", "description": "one output per input, in order"})


class JobFailure(Schema):
    code = fields.String(required=True, validate=validate.OneOf([c.value for c in ErrorCode]))
    message = fields.String(required=True)


class Job(Schema):
    id = fields.String(required=True, metadata=_UUID)
    url = fields.String(required=True, metadata={"description": "where to read it"})
    model = fields.String(required=True)
    status = fields.String(required=True, validate=validate.OneOf(STATUSES))
    created_at = fields.String(required=True, metadata={"format": "date-time"})
    started_at = fields.String(required=True, allow_none=True, metadata={"format": "date-time"})
    finished_at = fields.String(required=True, allow_none=True,
                                metadata={"format": "date-time"})
    trace_id = fields.String()
    encoding_format = fields.String(required=True, validate=validate.OneOf(ENCODINGS),
                                    metadata={"description": "how `result.outputs` travel"})
    progress = fields.Nested(Progress, required=True, metadata={
        "description": "inputs done: counted while a job spanning several model calls runs"})
    batch = fields.Nested(BatchInfo, metadata={"description": "the model call that ran it"})
    model_version = fields.String(metadata={
        "description": "the version of the model that gave the job its final status"})
    result = fields.Nested(JobResult, allow_none=True, metadata={
        "description": "once succeeded; null once the outputs expired (result_ttl_s)"})
    result_expired = fields.Boolean(metadata={"description": "the outputs expired"})
    error = fields.Nested(JobFailure, metadata={"description": "why it did not succeed"})
    retry_of = fields.String(metadata={"description": "the job this one retries", **_UUID})
    retried_as = fields.String(metadata={"description": "the job retrying this one", **_UUID})


class ListedJob(Job):
    """A job as a list shows it: without its outputs."""

    class Meta:
        exclude = ("result", "result_expired")


class JobList(Schema):
    jobs = fields.List(fields.Nested(ListedJob), required=True,
                       metadata={"description": "newest first, as GET shows each but its "
                                                "outputs"})
    next_cursor = fields.String(required=True, allow_none=True, metadata={
        "description": "pass as `cursor` for the next page; null when there is no more"})
    next = fields.String(required=True, allow_none=True,
                         metadata={"description": "the next page's URL, filters kept"})
    unreachable = fields.List(fields.String(), metadata={
        "description": "only while the Redis of a group does not answer: which (`redis:<group>`, "
                       "`redis` for REDIS_URL's); the page lacks that group's jobs (read the "
                       "first page again once it is back)"})


class Health(Schema):
    status = fields.String(required=True, validate=validate.OneOf(["ok"]))


class Check(Schema):
    ok = fields.Boolean(required=True)
    error = fields.String()
    instances = fields.Integer(metadata={"description": "live instances of the model"})


class Readiness(Schema):
    status = fields.String(required=True, validate=validate.OneOf(["ready", "not_ready"]))
    checks = fields.Dict(keys=fields.String(), values=fields.Nested(Check), required=True,
                         metadata={"description": "`redis`, `redis:<group>` per Redis group, "
                                                "and `model:<name>` per model"})


class ModelInput(Schema):
    type = fields.String(required=True, validate=validate.OneOf(INPUT_TYPES))
    shape = fields.List(fields.Integer())
    dtype = fields.String()
    sources = fields.List(fields.String())
    formats = fields.List(fields.String())
    preprocess = fields.Dict()


class ModelVersion(Schema):
    version = fields.String(required=True)
    workers = fields.Integer()
    instances = fields.Integer()


class Model(Schema):
    name = fields.String(required=True)
    kind = fields.String(required=True)
    queue = fields.String()
    input = fields.Nested(ModelInput, required=True)
    limits = fields.Dict(required=True, metadata={
        "description": "max_inputs, and the kind's own: max_input_chars, input_shape and "
                       "input_dtype, max_image_bytes and max_image_pixels"})
    labels = fields.List(fields.String())
    dtype = fields.String()
    max_batch_size = fields.Integer()
    max_wait_ms = fields.Float()
    max_queue_depth = fields.Integer()
    timeout_s = fields.Float(allow_none=True)
    time_limit_s = fields.Float(allow_none=True)
    options = fields.List(fields.String(), metadata={"description": "the options it takes"})
    workers = fields.Integer(allow_none=True, metadata={
        "description": "live worker nodes serving it (null: its Redis group is unreachable)"})
    instances = fields.Integer(allow_none=True, metadata={
        "description": "live copies of the model (null: its Redis group is unreachable)"})
    versions = fields.List(fields.Nested(ModelVersion), allow_none=True, metadata={
        "description": "the versions the live copies serve, with their workers and copies: "
                       "two during a reload"})
    unreachable = fields.String(metadata={
        "description": "only while the Redis of the model's group does not answer: which "
                       "(`redis:<group>`); its live counts are then unknown"})


class Models(Schema):
    revision = fields.String(metadata={
        "description": "the revision (a hash) of the models file this API process serves"})
    models = fields.List(fields.Nested(Model), required=True)


_SCHEMAS: dict[type[Schema], Schema] = {}


def dump(schema: type[Schema], body: Any) -> Any:
    """`body` as `schema` writes it (one instance per schema, made on first use)."""
    instance = _SCHEMAS.get(schema)
    if instance is None:
        instance = _SCHEMAS[schema] = schema()
    return instance.dump(body)


def answer(schema: type[Schema], body: Any, status: int = 200,
           headers: Mapping[str, str] | None = None, dumped: bool = False) -> Response:
    """The one way a JSON answer is written: dumped through the schema that documents it.
    `dumped`: `body` is as the schema dumps it already (`job_body`'s, which
    tests/unit/test_job_body.py holds to that), so the dump is not done twice a job."""
    return current_app.json.answer(body if dumped else dump(schema, body), status, headers)


def no_content() -> Response:
    """204, without a body or a Content-Type."""
    response = Response(status=204)
    del response.headers["Content-Type"]
    return response


def job_url(job_id: str) -> str:
    return f"/v1/jobs/{job_id}"


def _field_order(schema: type[Schema]) -> tuple[str, ...]:
    return tuple(field.data_key or name for name, field in schema().fields.items())


_JOB_ORDER = _field_order(Job)


def job_body(job: JobRecord, outputs: bool = True, peers: bool | None = None) -> dict[str, Any]:
    """A job as GET /v1/jobs/<id> shows it (`outputs`=False: without them, as listed),
    exactly as the `Job` schema dumps it (`answer`'s `dumped`): only its fields, each of the
    type it documents.
    `peers`: whether its batch's size is shown (its jobs may be other tenants'): by default
    only with API keys off, read from the request (outside one, say which)."""
    if peers is None:
        peers = g.get("api_key") is None  # app.auth.current_key(), which imports this module
    body: dict[str, Any] = {
        "id": job.id, "url": job_url(job.id), "model": job.model, "status": job.status.value,
        "created_at": iso(job.created_at),
        "started_at": iso(job.started_at) if job.started_at else None,
        "finished_at": iso(job.finished_at) if job.finished_at and job.terminal else None,
        # How the outputs travel, so that any reader (not only the submitter) decodes them.
        "encoding_format": job.encoding_format,
        "progress": {"items_done": job.inputs if job.status is Status.SUCCEEDED
                     else job.items_done, "items": max(job.inputs, 1)},
    }
    if job.trace_id:
        body["trace_id"] = job.trace_id
    if job.batch is not None:
        body["batch"] = job.batch if peers else {"id": job.batch["id"]}
    if job.model_version:
        body["model_version"] = job.model_version
    if job.retry_of:
        body["retry_of"] = job.retry_of
    if job.retried_as:
        body["retried_as"] = job.retried_as
    if job.status is Status.SUCCEEDED and outputs:
        # Outputs are kept result_ttl_s, the record job_ttl_s: past the first, say so.
        body["result"] = {"outputs": job.outputs} if job.outputs is not None else None
        if job.outputs is None:
            body["result_expired"] = True
    elif job.error is not None:
        body["error"] = job.error.to_dict()
    # In the order the schema dumps its fields, so the bytes are those the dump gave.
    return {key: body[key] for key in _JOB_ORDER if key in body}
