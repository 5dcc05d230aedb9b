"""Errors, one class per error code of the API's `{"error": {"code", "message", "fields"}}`,
and the few the client raises of its own accord. Catch `IQError` for all of them."""
from __future__ import annotations

from email.utils import parsedate_to_datetime
from datetime import datetime, timezone
from typing import Any


class IQError(Exception):
    """Anything this client raises on purpose."""


class APIError(IQError):
    """The API answered with an error. `code`, `message` and `fields` are its error object's
    members; `body` is the whole object (a 409 also carries the job's `status`)."""

    code = "error"

    def __init__(self, http_status: int, body: dict[str, Any],
                 retry_after: float | None = None) -> None:
        self.http_status = http_status
        self.body = body
        self.code = str(body.get("code", self.code))
        self.message = str(body.get("message", ""))
        self.fields: dict[str, list[str]] = body.get("fields") or {}
        self.retry_after = retry_after
        detail = "; ".join(f"{name}: {' '.join(map(str, why))}"
                           for name, why in self.fields.items())
        super().__init__(f"{http_status} {self.code}: {self.message}"
                         + (f" ({detail})" if detail else ""))


class MalformedRequest(APIError):
    """400: the body is not JSON."""
    code = "malformed_request"


class Unauthorized(APIError):
    """401: API keys are configured and none, or an unknown one, was given."""
    code = "unauthorized"


class Forbidden(APIError):
    """403: this API key may not use the model."""
    code = "forbidden"


class NotFound(APIError):
    """404: no such job (never issued, expired, or another key's), or no such route."""
    code = "not_found"


class MethodNotAllowed(APIError):
    """405."""
    code = "method_not_allowed"


class Conflict(APIError):
    """409: the job's status does not allow it (`job_status` says which: a cancel of a job
    running or finished, a retry of one that succeeded, a delete of one not finished), a job
    retried already (`retried_as`), or an Idempotency-Key reused with another body."""
    code = "conflict"

    @property
    def job_status(self) -> str | None:
        return self.body.get("status")

    @property
    def retried_as(self) -> str | None:
        return self.body.get("retried_as")


class PayloadTooLarge(APIError):
    """413: the body is over the API's max_body_bytes."""
    code = "payload_too_large"


class UnsupportedMediaType(APIError):
    """415."""
    code = "unsupported_media_type"


class ValidationError(APIError):
    """422: `fields` names each bad field (`inputs.3`, `options.labels`, ...)."""
    code = "validation_error"


class Overloaded(APIError):
    """429: the model's queue is full; retried after Retry-After until `retry_for` runs out."""
    code = "overloaded"


class RateLimited(APIError):
    """429: this key's rate limit is used up; retried like Overloaded."""
    code = "rate_limited"


class Unavailable(APIError):
    """503: the API cannot reach Redis; retried after Retry-After."""
    code = "unavailable"


class InvalidRequest(IQError, ValueError):
    """A request the client cannot send: its body is not JSON (a NaN or an infinity among
    the inputs, a value of a type JSON does not have)."""


class ConfigurationError(IQError, ValueError):
    """The client's environment is wrong: a misspelt IQ_ variable (named with the closest one
    the client reads), or an IQ_PORT that is not a port."""


class MissingDependency(IQError, ImportError):
    """An optional dependency a call needs is not installed (numpy for `Job.array()`)."""


class ConnectionFailed(IQError):
    """The API could not be reached, or dropped the connection, for longer than `retry_for`."""


class JobFailed(IQError):
    """A job ended without outputs: failed, cancelled or expired. `job` is it as it ended."""

    def __init__(self, job: Any) -> None:
        self.job = job
        error = job.error or {}
        self.code = error.get("code", job.status)
        super().__init__(f"job {job.id} {job.status}: "
                         f"{error.get('code', job.status)}: {error.get('message', '')}")


class WaitTimeout(IQError):
    """The job was not finished when the wait's timeout ran out. `job` is it as it stands."""

    def __init__(self, job: Any, timeout: float) -> None:
        self.job = job
        super().__init__(f"job {job.id} still {job.status} after {timeout:g}s")


class DecodeError(IQError):
    """An output that should be base64 float32 is not."""


def _all(cls: type[APIError]) -> list[type[APIError]]:
    return [cls] + [d for sub in cls.__subclasses__() for d in _all(sub)]


_BY_CODE = {cls.code: cls for cls in _all(APIError)}
_BY_STATUS = {400: MalformedRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound,
              405: MethodNotAllowed, 409: Conflict, 413: PayloadTooLarge,
              415: UnsupportedMediaType, 422: ValidationError, 429: Overloaded,
              503: Unavailable}


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header: a number of seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max((when - datetime.now(timezone.utc)).total_seconds(), 0.0)


def api_error(http_status: int, payload: Any, retry_after: str | None = None) -> APIError:
    """The typed error for an error response: by its `code`, else by its HTTP status (a proxy's
    own 502 page has no error object)."""
    body = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(body, dict):
        body = {"code": f"http_{http_status}",
                "message": (payload if isinstance(payload, str) else "")[:200]}
    cls = _BY_CODE.get(str(body.get("code"))) or _BY_STATUS.get(http_status, APIError)
    return cls(http_status, body, parse_retry_after(retry_after))
