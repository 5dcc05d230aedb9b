"""Task and queue names. The API sends tasks by these names; workers register them."""
from __future__ import annotations

from typing import Iterable

TASK_PREFIX = "iq.infer."


def task_name(model: str) -> str:
    return f"{TASK_PREFIX}{model}"


def model_of_task(name: str) -> str | None:
    return name[len(TASK_PREFIX):] if name.startswith(TASK_PREFIX) else None


def task_routes(specs: Iterable) -> dict[str, dict[str, str]]:
    """One queue per model: `task_routes` for the Celery app."""
    return {task_name(s.name): {"queue": s.queue} for s in specs}
