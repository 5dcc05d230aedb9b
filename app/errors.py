"""Every error the API returns, and the one place they become HTTP responses:
`{"error": {"code", "message", "fields"?}}`, dumped through the `Error` schema that documents
them (app/responses.py)."""
from __future__ import annotations

import logging
import sys
from itertools import islice
from typing import Any, Iterable, Mapping

import redis
from flask import Flask
from kombu.exceptions import OperationalError
from werkzeug.exceptions import HTTPException

from app.responses import Error, answer
from tasks.redis_client import is_out_of_memory

logger = logging.getLogger(__name__)

# An error names at most this many fields (and counts the rest): a body of 100,000 bad keys
# gets an answer of a few kilobytes, not megabytes.
MAX_ERROR_FIELDS = 30
_MAX_FIELD_NAME = 100

Fields = Mapping[str, list[str]] | Iterable[tuple[str, list[str]]]


def _capped(fields: Fields) -> tuple[dict[str, list[str]], int]:
    """At most MAX_ERROR_FIELDS fields, long names cut, each with at most 3 messages; and
    how many more there were."""
    pairs = iter(fields.items() if isinstance(fields, Mapping) else fields)
    shown: dict[str, list[str]] = {}
    for name, messages in islice(pairs, MAX_ERROR_FIELDS):
        if len(name) > _MAX_FIELD_NAME:
            name = name[:_MAX_FIELD_NAME - 3] + "..."
        shown[name] = [str(m)[:500] for m in messages[:3]]
    return shown, sum(1 for _ in pairs)


def json_problem(exc: Exception) -> str:
    """What Python's json said was wrong with a body it refused, in the API's words where
    Python's name its own internals: a number of more than 4,300 digits (its
    int_max_str_digits) was answered "use sys.set_int_max_str_digits() to increase the limit"."""
    said = str(exc)
    if "integer string conversion" in said:
        return f"a number of more than {sys.get_int_max_str_digits()} digits"
    return said


class APIError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, fields: Fields | None = None,
                 headers: dict[str, str] | None = None, retry_after: int | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields, self.fields_omitted = _capped(fields) if fields is not None else (None, 0)
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)
        self.extra = extra  # more members of the error object, e.g. a job's status


class Unauthorized(APIError):
    status, code = 401, "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="inference-queue"'})


class Forbidden(APIError):
    status, code = 403, "forbidden"


class RateLimited(APIError):
    status, code = 429, "rate_limited"


class MalformedRequest(APIError):
    status, code = 400, "malformed_request"


class NotFound(APIError):
    status, code = 404, "not_found"


class MethodNotAllowed(APIError):
    status, code = 405, "method_not_allowed"


class PayloadTooLarge(APIError):
    status, code = 413, "payload_too_large"


class UnsupportedMediaType(APIError):
    status, code = 415, "unsupported_media_type"


class Conflict(APIError):
    status, code = 409, "conflict"


class ValidationFailed(APIError):
    status, code = 422, "validation_error"


class TooManyJobs(APIError):
    status, code = 429, "overloaded"


class KeptRequestsFull(APIError):
    """The requests Redis keeps for this API key would pass its quota (kept_bytes_per_key)."""
    status, code = 429, "kept_full"


class TooManyUploads(APIError):
    """The key is sending as many request bodies at once as it may (max_uploads_per_key). The
    body is left unread: gunicorn closes the connection unless the rest of it arrives within
    its keep-alive (2 s)."""
    status, code = 429, "too_many_uploads"

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=1)


class TooManyWaits(APIError):
    """Every wait slot (app/waiter.py) is taken; `status` carries the job's as it stands."""
    status, code = 429, "too_many_waits"


class Unavailable(APIError):
    status, code = 503, "unavailable"


_HTTP_ERRORS: dict[int, type[APIError]] = {
    400: MalformedRequest, 404: NotFound, 405: MethodNotAllowed, 413: PayloadTooLarge,
    415: UnsupportedMediaType,
}


def error_response(err: APIError):
    body: dict[str, Any] = {"code": err.code, "message": err.message}
    if err.fields:
        body["fields"] = err.fields
    if err.fields_omitted:
        body["fields_omitted"] = err.fields_omitted
    body.update(getattr(err, "extra", {}))
    return answer(Error, {"error": body}, err.status, err.headers)


# How a job's status reads in a sentence: "the job has succeeded", "the job is queued".
_STATUS_SAID = {"queued": "is queued", "running": "is running", "succeeded": "has succeeded",
                "failed": "has failed", "cancelled": "was cancelled", "expired": "has expired"}


def job_is(status: str) -> str:
    """`the job <status said>`, for messages about what a job's status allows."""
    return f"the job {_STATUS_SAID.get(status, f'is {status}')}"


def register_error_handlers(app: Flask) -> None:
    app.register_error_handler(APIError, error_response)

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        cls = _HTTP_ERRORS.get(exc.code or 500)
        if cls is None:
            err = APIError(exc.description or exc.name)
            err.status, err.code = exc.code or 500, exc.name.lower().replace(" ", "_")
        else:
            err = cls(_MESSAGES.get(exc.code, exc.description or exc.name))
        response = error_response(err)
        if exc.code == 405 and exc.valid_methods:
            response.headers["Allow"] = ", ".join(sorted(exc.valid_methods))
        return response

    @app.errorhandler(redis.RedisError)
    @app.errorhandler(OperationalError)
    def _broker_down(exc: Exception):
        logger.warning("Redis unavailable: %s", exc)
        if is_out_of_memory(exc):
            # maxmemory with noeviction: Redis refuses new writes until results expire (or it
            # is given more memory); nothing stored is dropped meanwhile.
            return error_response(Unavailable("the job store (Redis) is full; retry later",
                                              retry_after=30))
        if "NOREPLICAS" in str(exc):
            # min-replicas-to-write (make run with replicas): the primary has no replica in
            # sync, a failover under way or a replica restarting; nothing was written.
            return error_response(Unavailable("the job store (Redis) refuses writes until its "
                                              "primary has a replica in sync; retry later",
                                              retry_after=1))
        # Retry-After 1: Redis restarted under a supervisor is back in a second or a few, and
        # the client waits what it is told (at 5 s, every submit refused during a restart got
        # its job id more than 5 s after it was sent: bench/gameday's availability).
        return error_response(Unavailable("the job store (Redis) is unreachable; retry later",
                                          retry_after=1))

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        logger.exception("unhandled error")
        return error_response(APIError("internal error"))


_MESSAGES = {
    404: "no such resource",
    405: "method not allowed on this resource",
    413: "request body is larger than the configured limit",
}
