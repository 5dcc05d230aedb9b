"""A model's Celery task in the worker: registered for each model at start (workers/main.py)
and for a model a reload adds (workers/batching/reload.py). Its jobs never run one by one: its
Strategy hands them to the dispatcher (workers/batching/strategy.py)."""
from __future__ import annotations

from typing import Any

from celery import Task

from tasks.names import task_name


class BatchingTask(Task):
    """A model's task. Messages never reach `run` one by one: the Strategy buffers them and
    the pool runs whole batches (workers.child.execute.run_batch)."""

    Strategy = "workers.batching.strategy:batching_strategy"
    acks_late = True
    reject_on_worker_lost = True
    typing = False


def register_model(app: Any, model: str) -> Any:
    """The model's task in `app` (at start, and for a model a reload adds)."""
    def infer(inputs: list, options: dict | None = None) -> dict:
        raise NotImplementedError("model tasks run in batches inside a worker")

    return app.task(name=task_name(model), base=BatchingTask, shared=False)(infer)
