"""The failure a job ends with, as stored in the result backend and shown by the API."""
from __future__ import annotations


class JobFailed(Exception):
    """A job failed with a stable `code` (e.g. `inference_error`, `invalid_input`) and a
    human-readable message. Stored by Celery as the task's exception."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"
