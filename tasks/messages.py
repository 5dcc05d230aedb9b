"""The task message format both sides agree on: a model task's arguments (`JobArgs`), and a
Celery task message built exactly as `send_task` would publish it, so that the API's atomic
submit (tasks/jobstate.py pushes it in the same script as the job record) and a pool child's
webhook delivery need no kombu connection of their own. A message is filled in from a template
Celery built once a process (`_Template`), not built by Celery each time."""
from __future__ import annotations

import base64
from binascii import b2a_base64
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


class _Template(NamedTuple):
    """What Celery's `as_task_v2` builds alike for every task message of an app: its headers
    and properties, the message's own parts to be written over them (`_filled`), and the
    body's third part. Made at the process's first message (`_current`), and used only when
    it builds a probe message byte for byte as Celery builds it (`_made`); else Celery builds
    each message (`_by_celery`), as it did before: ~20 Python calls a message fewer."""
    app: Any
    pid: int
    origin: str
    amqp: Any
    headers: dict[str, Any] | None  # None: Celery's builds what this cannot; it builds each
    properties: dict[str, Any]
    embed: dict[str, Any]


_template: _Template | None = None


def _current(app: Any) -> _Template:
    """The template of `app`'s messages in this process, made at its first message."""
    global _template
    if _template is None or _template.app is not app or _template.pid != pid():
        _template = _made(app)
    return _template


def _made(app: Any) -> _Template:
    origin, amqp = _origin_name(), app.amqp
    built = amqp.as_task_v2("\0id", "\0task", kwargs={}, argsrepr="()", kwargsrepr="",
                            ignore_result=None, retries=0, origin=origin)
    template = _Template(app, pid(), origin, amqp, dict(built.headers),
                         dict(built.properties), dict(built.body[2]))
    probe = ("iq.probe", "p-1", {"inputs": [1]}, "probe", 3, {"x": "y"}, {"m": 1}, 2)
    (mine, my_tag), (celerys, its_tag) = _filled(template, *probe), _by_celery(app, *probe)
    if mine.replace(my_tag.encode(), its_tag.encode()) != celerys:
        return template._replace(headers=None)  # a Celery that builds otherwise: its own way
    return template


def _filled(template: _Template, name: str, task_id: str, kwargs: Mapping[str, Any],
            queue: str, priority: int, headers: Mapping[str, Any] | None,
            summary: Mapping[str, Any] | None, retries: int) -> tuple[bytes, str]:
    """`_by_celery`'s message (its payload and the delivery tag in it) from `template`: the
    headers `as_task_v2` sets from a message's own arguments (its task's name, its id and root
    id, retries, origin) and kwargsrepr written over the template's, in their places."""
    raw = orjson.dumps(((), kwargs, template.embed), option=results.JSON_OPTIONS)
    kwargsrepr = repr({**summary, "bytes": len(raw)}) if summary is not None \
        else saferepr(dict(kwargs), template.amqp.kwargsrepr_maxsize)
    return _envelope(b2a_base64(raw, newline=False).decode(),
                     {**template.headers, "task": name, "id": task_id, "root_id": task_id,
                      "retries": retries, "kwargsrepr": kwargsrepr, "origin": template.origin,
                      **(headers or {})},
                     {**template.properties, "correlation_id": task_id}, queue, priority)


def _by_celery(app: Any, name: str, task_id: str, kwargs: Mapping[str, Any], queue: str,
               priority: int, headers: Mapping[str, Any] | None,
               summary: Mapping[str, Any] | None, retries: int) -> tuple[bytes, str]:
    """The message `app.send_task` would publish, built by Celery's `as_task_v2` (its payload
    and the delivery tag in it)."""
    as_task = app.amqp.as_task_v2(task_id, name, kwargs=dict(kwargs), argsrepr="()",
                                  kwargsrepr="", ignore_result=None,  # as send_task does
                                  retries=retries, origin=_origin_name())
    raw = orjson.dumps(as_task.body, option=results.JSON_OPTIONS)
    kwargsrepr = repr({**summary, "bytes": len(raw)}) if summary is not None \
        else saferepr(dict(kwargs), app.amqp.kwargsrepr_maxsize)
    message = as_task._replace(headers={**as_task.headers, "kwargsrepr": kwargsrepr})
    return _envelope(base64.b64encode(raw).decode(), {**message.headers, **(headers or {})},
                     message.properties, queue, priority)


def _envelope(body: str, headers: Mapping[str, Any], properties: Mapping[str, Any], queue: str,
              priority: int) -> tuple[bytes, str]:
    """kombu's Redis message around a task's base64 body: its payload, and the delivery tag
    in it."""
    tag = uuid4_text()
    payload = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            **properties,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
            "body_encoding": "base64",
            "delivery_tag": tag,
        },
    }
    return orjson.dumps(payload), tag


def task_message(app: Any, name: str, task_id: str, kwargs: Mapping[str, Any], *, queue: str,
                 priority: int, headers: Mapping[str, Any] | None = None,
                 summary: Mapping[str, Any] | None = None, retries: int = 0) -> QueuedMessage:
    """The message `app.send_task(name, kwargs=..., task_id=..., queue=..., priority=...)`
    would push (`retries`: as a task's retry would). With `summary`, task events (Flower) show
    it and the body's size in place of the arguments themselves. Built from the app's
    template (`_Template`): the same bytes as Celery's `as_task_v2` builds, without its
    work for each message."""
    template = _current(app)
    if template.headers is None:
        payload, _ = _by_celery(app, name, task_id, kwargs, queue, priority, headers, summary,
                                retries)
    else:
        payload, _ = _filled(template, name, task_id, kwargs, queue, priority, headers,
                             summary, retries)
    return QueuedMessage(list_for(queue, priority), payload, task_id)
