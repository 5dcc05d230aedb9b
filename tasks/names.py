"""Task and queue names. The API sends tasks by these names; workers register them."""
from __future__ import annotations

import functools
from bisect import bisect
from typing import Iterable

TASK_PREFIX = "iq.infer."


def task_name(model: str) -> str:
    return f"{TASK_PREFIX}{model}"


def model_of_task(name: str) -> str | None:
    return name[len(TASK_PREFIX):] if name.startswith(TASK_PREFIX) else None


def task_routes(specs: Iterable) -> dict[str, dict[str, str]]:
    """One queue per model: `task_routes` for the Celery app."""
    return {task_name(s.name): {"queue": s.queue} for s in specs}


# Redis priority steps (kombu): a lower number is served first. Each step is its own list.
PRIORITIES = {"high": 0, "normal": 5, "low": 9}
PRIORITY_STEPS = sorted(PRIORITIES.values())
PRIORITY_SEP = "\x06\x16"  # kombu's default separator between queue name and step


def queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold a queue's waiting messages, one per priority step."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


@functools.lru_cache(maxsize=1024)
def list_for(queue: str, priority: int) -> str:
    """The Redis list kombu keeps a queue's messages of this priority in (Channel._q_for_pri
    with make_celery's priority steps); worked out once a queue and priority, as every
    submit asks it."""
    step = PRIORITY_STEPS[max(bisect(PRIORITY_STEPS, priority) - 1, 0)]
    return f"{queue}{PRIORITY_SEP}{step}" if step else queue
