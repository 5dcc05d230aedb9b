"""Why a job failed or did not run: one type, `JobError`, with a stable code and a message for
people. A handler returns one for a job that failed; the worker stores it in the job record
(as JSON) and Celery stores it as the task's exception (AsyncResult raises it again); the API
shows its code and message."""
from __future__ import annotations

import enum

import orjson


class ErrorCode(enum.StrEnum):
    INFERENCE_ERROR = "inference_error"  # the model raised on the job's inputs
    MODEL_UNAVAILABLE = "model_unavailable"  # the worker has no such model configured
    MODEL_REMOVED = "model_removed"  # a reload removed its model before it ran
    TIMEOUT = "timeout"  # it ran past the model's time limit, alone in its batch
    CRASHED = "crashed"  # its model call took the model's process down, max_job_crashes times
    WORKER_ERROR = "worker_error"  # its batch call broke outside the model
    CANCELLED = "cancelled"  # cancelled before it ran
    EXPIRED = "expired"  # not started before its deadline


class JobError(Exception):
    """A job's error: `code` (an ErrorCode) and `message`. Equal when both are."""

    def __init__(self, code: ErrorCode | str, message: str) -> None:
        code = ErrorCode(code)
        super().__init__(code.value, message)  # plain strings: Celery stores the args as JSON
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobError) and \
            (self.code, self.message) == (other.code, other.message)

    def __hash__(self) -> int:
        return hash((self.code, self.message))

    def to_dict(self) -> dict[str, str]:
        """As the API and webhooks show it."""
        return {"code": self.code.value, "message": self.message}

    def to_json(self) -> str:
        return orjson.dumps(self.to_dict()).decode()

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobError:
        data = orjson.loads(raw)
        return cls(data["code"], data["message"])


def removed_error(model: str) -> JobError:
    """The error of a job whose model a reload removed before it ran (a worker's, or the
    reload's own for the jobs still queued: scripts/reload_removed.py)."""
    return JobError(ErrorCode.MODEL_REMOVED,
                    f"model {model} was removed from the models file by a reload before the "
                    "job ran")
