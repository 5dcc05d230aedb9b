"""The task message format both sides agree on: a model task's arguments (`JobArgs`), and a
Celery task message built exactly as `send_task` would publish it, so that the API's atomic
submit (tasks/jobstate.py pushes it in the same script as the job record) and a pool child's
webhook delivery need no kombu connection of their own."""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import orjson
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr

from config.job_ids import uuid4_text
from config.process import pid
from tasks import results
from tasks.names import list_for


# The message header that carries the job's token (tasks/jobstate.py): a job runs only from a
# message that holds its record's token.
JOB_TOKEN_HEADER = "job_token"


class JobArgs(NamedTuple):
    """What a job asks of its model: its task's kwargs, as the API writes them and a worker
    reads them."""
    inputs: list
    options: dict
    submitted_at: float | None = None  # Unix time, for the queue-wait metric and traces
    webhook: dict | None = None  # {"url", "events"}

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"inputs": self.inputs, "options": self.options,
                               "submitted_at": self.submitted_at}
        if self.webhook:
            out["webhook"] = self.webhook
        return out

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any] | None) -> JobArgs:
        """A received task's kwargs, read as leniently as a hand-made message needs."""
        kwargs = kwargs or {}
        inputs, options = kwargs.get("inputs"), kwargs.get("options")
        submitted = kwargs.get("submitted_at")
        return cls(inputs if isinstance(inputs, list) else [],
                   options if isinstance(options, dict) else {},
                   submitted if isinstance(submitted, (int, float)) else None,
                   kwargs.get("webhook") or None)


@dataclass(frozen=True)
class QueuedMessage:
    """A task message ready for its Redis list."""
    list_key: str
    payload: bytes
    task_id: str = ""  # its task's id (a webhook delivery's: its webhook-id)


_origin: tuple[int, str] = (0, "")


def _origin_name() -> str:
    """The message's `origin`, `gen<pid>@<host>` as Celery names it for each message
    (`anon_nodename`, whose memoised host lookup takes a lock: gevent's, in the API), named
    once a process (a fork's child names its own)."""
    global _origin
    if _origin[0] != pid():
        _origin = (pid(), anon_nodename())
    return _origin[1]


def task_message(app: Any, name: str, task_id: str, kwargs: Mapping[str, Any], *, queue: str,
                 priority: int, headers: Mapping[str, Any] | None = None,
                 summary: Mapping[str, Any] | None = None, retries: int = 0) -> QueuedMessage:
    """The message `app.send_task(name, kwargs=..., task_id=..., queue=..., priority=...)`
    would push (`retries`: as a task's retry would). With `summary`, task events (Flower) show
    it and the body's size in place of the arguments themselves."""
    as_task = app.amqp.as_task_v2(task_id, name, kwargs=dict(kwargs), argsrepr="()",
                                  kwargsrepr="", ignore_result=None,  # as send_task does
                                  retries=retries, origin=_origin_name())
    raw = orjson.dumps(as_task.body, option=results.JSON_OPTIONS)
    kwargsrepr = repr({**summary, "bytes": len(raw)}) if summary is not None \
        else saferepr(dict(kwargs), app.amqp.kwargsrepr_maxsize)
    message = as_task._replace(headers={**as_task.headers, "kwargsrepr": kwargsrepr})
    body = base64.b64encode(raw).decode()
    payload = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {**message.headers, **(headers or {})},
        "properties": {
            **message.properties,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
            "body_encoding": "base64",
            "delivery_tag": uuid4_text(),
        },
    }
    return QueuedMessage(list_for(queue, priority), orjson.dumps(payload), task_id)
