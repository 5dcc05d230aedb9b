"""The API's OpenAPI document, built from the configured models (served at /openapi.json)."""
from __future__ import annotations

from typing import Any

from config.models import ModelSpec
from config.preprocess import IMAGE_FORMATS
from tasks.names import PRIORITIES

_ERROR = {"$ref": "#/components/schemas/Error"}


# Image models also take their inputs as uploaded bytes (app/uploads.py).
_UPLOADS = {
    "multipart/form-data": {"schema": {
        "type": "object", "required": ["job", "inputs"], "properties": {
            "job": {"type": "string",
                    "description": "the job as JSON (model, options, ...), without inputs"},
            "inputs": {"type": "array", "items": {"type": "string", "format": "binary"},
                       "description": "one file part per image, in input order"}}}},
    "image/*": {"schema": {"type": "string", "format": "binary"},
                "description": "one image; the model (and priority, timeout_s) in the query"},
}


_UPLOAD_QUERY = [
    {"name": name, "in": "query", "schema": schema,
     "description": f"with an image/* body only: the job's {name}"}
    for name, schema in (("model", {"type": "string"}),
                         ("priority", {"type": "string", "enum": list(PRIORITIES)}),
                         ("timeout_s", {"type": "number"}))]


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": _ERROR}}}


def _input_schema(spec: ModelSpec) -> dict[str, Any]:
    if spec.input_type == "text":
        return {"type": "string", "maxLength": spec.max_input_chars,
                "description": "a text; longer ones are refused, over-long token sequences "
                               "truncated at the model's max_seq_length"}
    if spec.input_type == "image":
        return {"type": "string", "minLength": 1, "description": (
            f"an image ({', '.join(IMAGE_FORMATS)}) as base64, a data: URI or an http(s) URL; "
            f"or send the bytes as multipart/form-data or an image/* body. At most "
            f"{spec.max_image_bytes} bytes and {spec.max_image_pixels} pixels; resized and "
            f"cropped to {spec.preprocess.size[0]}x{spec.preprocess.size[1]} "
            f"(height x width) before queueing")}
    schema: dict[str, Any] = {"type": "integer" if spec.input_dtype == "int64" else "number"}
    for size in reversed(spec.input_shape):
        schema = {"type": "array", "items": schema, "minItems": size, "maxItems": size}
    schema["description"] = f"a {spec.input_dtype} tensor of shape {list(spec.input_shape)}"
    return schema


def _options_schema(spec: ModelSpec) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    if "labels" in spec.options:
        properties["labels"] = {"type": "array", "minItems": 1, "maxItems": spec.max_labels,
                                "items": {"type": "string", "minLength": 1, "maxLength": 200}}
    if "top_k" in spec.options:
        properties["top_k"] = {"type": "integer", "minimum": 1,
                               "maximum": max(len(spec.labels), spec.top_k)}
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _job_request(spec: ModelSpec) -> dict[str, Any]:
    """One model's job: its own input kind, limits and options."""
    return {
        "title": spec.name,
        "description": f"kind {spec.kind}: {spec.input_type} inputs, at most "
                       f"{spec.max_inputs} a job",
        "type": "object", "required": ["model", "inputs"], "additionalProperties": False,
        "properties": {
            "model": {"type": "string", "enum": [spec.name]},
            "inputs": {"type": "array", "minItems": 1, "maxItems": spec.max_inputs,
                       "items": _input_schema(spec)},
            "options": _options_schema(spec),
            "timeout_s": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                          "maximum": 86400},
            "priority": {"type": "string", "enum": list(PRIORITIES)},
            "encoding_format": {"type": "string",
                                "enum": ["float", "base64"] if spec.kind == "embedding"
                                else ["float"]},
        }}


_MODEL = {"type": "object", "required": ["name", "kind", "input", "limits"], "properties": {
    "name": {"type": "string"}, "kind": {"type": "string"}, "queue": {"type": "string"},
    "input": {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "tensor", "image"]},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "dtype": {"type": "string"}, "sources": {"type": "array"},
        "formats": {"type": "array"}, "preprocess": {"type": "object"}}},
    "limits": {"type": "object", "properties": {
        "max_inputs": {"type": "integer"}, "max_input_chars": {"type": "integer"},
        "input_shape": {"type": "array"}, "input_dtype": {"type": "string"},
        "max_image_bytes": {"type": "integer"}, "max_image_pixels": {"type": "integer"}}},
    "labels": {"type": "array", "items": {"type": "string"}},
    "dtype": {"type": "string"}, "max_batch_size": {"type": "integer"},
    "max_wait_ms": {"type": "number"}, "workers": {"type": "integer"},
    "instances": {"type": "integer"}}}


def openapi(models: dict[str, ModelSpec]) -> dict[str, Any]:
    jobs = [_job_request(s) for s in models.values()]
    uploads = any(s.input_type == "image" for s in models.values())
    job_id = {"name": "job_id", "in": "path", "required": True,
              "schema": {"type": "string", "format": "uuid"}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "inference-queue", "version": "1",
                 "description": "Submit inference jobs and poll (or wait on) their results."},
        "paths": {
            "/v1/jobs": {"post": {
                "summary": "Submit a job",
                "parameters": [
                    {"name": "X-Request-ID", "in": "header", "schema": {"type": "string"}},
                    {"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"}},
                    {"name": "Prefer", "in": "header", "schema": {"type": "string"},
                     "description": "wait=S: answer 201 with the finished job if it is done "
                                    "within S seconds (RFC 7240)"},
                    *(_UPLOAD_QUERY if uploads else [])],
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/JobRequest"}},
                    **(_UPLOADS if uploads else {})}},
                "responses": {
                    "201": {"description": "finished within Prefer: wait",
                            "content": {"application/json": {"schema": {
                                "$ref": "#/components/schemas/Job"}}}},
                    "202": {"description": "accepted",
                            "content": {"application/json": {"schema": {
                                "$ref": "#/components/schemas/JobAccepted"}}}},
                    "400": _error("malformed JSON"), "409": _error("Idempotency-Key reuse"),
                    "413": _error("body too large"), "415": _error("not JSON"),
                    "422": _error("invalid job"), "429": _error("queue full"),
                    "503": _error("Redis unreachable")}}},
            "/v1/jobs/{job_id}": {
                "get": {"summary": "Read a job", "parameters": [job_id, {
                    "name": "wait", "in": "query",
                    "schema": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                               "maximum": 30}}],
                    "responses": {"200": {"description": "the job", "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Job"}}}},
                        "404": _error("unknown job"), "422": _error("bad wait"),
                        "503": _error("Redis unreachable")}},
                "delete": {"summary": "Cancel a queued job", "parameters": [job_id],
                           "responses": {"200": {"description": "cancelled"},
                                         "404": _error("unknown job"),
                                         "409": _error("already running or finished")}}},
            "/v1/models": {"get": {
                "summary": "Configured models: each one's input kind, limits and live workers",
                "responses": {"200": {"description": "models", "content": {
                    "application/json": {"schema": {
                        "type": "object", "properties": {"models": {
                            "type": "array",
                            "items": {"$ref": "#/components/schemas/Model"}}}}}}}}}},
            "/healthz": {"get": {"responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"responses": {"200": {"description": "ready"},
                                              "503": {"description": "not ready"}}}},
        },
        "components": {"schemas": {
            # One schema per model (oneOf, told apart by `model`): each model's own input
            # kind, limits and options.
            "JobRequest": {"oneOf": jobs} if len(jobs) > 1 else jobs[0],
            "Model": _MODEL,
            "JobAccepted": {"type": "object", "required": ["id", "status", "url"], "properties": {
                "id": {"type": "string"}, "status": {"type": "string"},
                "model": {"type": "string"}, "created_at": {"type": "string"},
                "url": {"type": "string"}, "trace_id": {"type": "string"}}},
            "Job": {"type": "object", "required": ["id", "status"], "properties": {
                "id": {"type": "string"},
                "status": {"type": "string", "enum": ["queued", "running", "succeeded", "failed",
                                                      "cancelled", "expired"]},
                "result": {"type": "object"}, "error": {"type": "object"}}},
            "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["code", "message"], "properties": {
                    "code": {"type": "string"}, "message": {"type": "string"},
                    "fields": {"type": "object"}}}}},
        }},
    }
