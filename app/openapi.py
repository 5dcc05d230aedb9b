"""The API's OpenAPI document, built from the configured models (served at /openapi.json)."""
from __future__ import annotations

from typing import Any

from config.models import TEXT_KINDS, ModelSpec
from tasks.names import PRIORITIES

_ERROR = {"$ref": "#/components/schemas/Error"}


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": _ERROR}}}


def _input_schema(spec: ModelSpec) -> dict[str, Any]:
    if spec.kind in TEXT_KINDS:
        return {"type": "string", "maxLength": spec.max_input_chars}
    schema: dict[str, Any] = {"type": "integer" if spec.input_dtype == "int64" else "number"}
    for size in reversed(spec.input_shape):
        schema = {"type": "array", "items": schema, "minItems": size, "maxItems": size}
    return schema


def openapi(models: dict[str, ModelSpec]) -> dict[str, Any]:
    inputs = [_input_schema(s) for s in models.values()]
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
                                    "within S seconds (RFC 7240)"}],
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/JobRequest"}}}},
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
            "/v1/models": {"get": {"summary": "Configured models",
                                   "responses": {"200": {"description": "models"}}}},
            "/healthz": {"get": {"responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"responses": {"200": {"description": "ready"},
                                              "503": {"description": "not ready"}}}},
        },
        "components": {"schemas": {
            "JobRequest": {
                "type": "object", "required": ["model", "inputs"], "additionalProperties": False,
                "properties": {
                    "model": {"type": "string", "enum": sorted(models)},
                    "inputs": {"type": "array", "minItems": 1,
                               "maxItems": max(s.max_inputs for s in models.values()),
                               "items": {"oneOf": inputs} if len(inputs) > 1 else inputs[0]},
                    "options": {"type": "object", "properties": {
                        "labels": {"type": "array", "items": {"type": "string"}}},
                        "additionalProperties": False},
                    "timeout_s": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                  "maximum": 86400},
                    "priority": {"type": "string", "enum": list(PRIORITIES)},
                }},
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
