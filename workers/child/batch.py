"""What a worker's main process and its pool child exchange for one batch, as small typed
values: the jobs (`BatchJob`), and per job an outcome (`JobOutcome`). And each job's terminal
step (`Final`: status, stored result, webhook), built the same way by the child from the
model's results and by the parent for a batch that never returned."""
from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from tasks import results
from tasks.errors import JobError
from tasks.jobstate import Final, StartDecision, Status
from tasks.messages import JOB_TOKEN_HEADER, JobArgs, QueuedMessage, task_message
from tasks.names import PRIORITIES
from tasks.webhooks import DELIVER_TASK
from tasks.webhooks import QUEUE as WEBHOOK_QUEUE

_TRACE_HEADERS = ("trace_id", "traceparent", "tracestate")
_CARRIED = (*_TRACE_HEADERS, JOB_TOKEN_HEADER)


def _headers(request: Any, names: tuple[str, ...]) -> dict[str, str]:
    found = request.request_dict
    nested = found.get("headers") or {}
    return {k: v for k in names if (v := found.get(k) or nested.get(k))}


def trace_headers(request: Any) -> dict[str, str]:
    """A received job's trace id and W3C trace context, from its message headers."""
    return _headers(request, _TRACE_HEADERS)


def job_token(request: Any) -> str:
    """The job's token as a received message carries it ('' : none)."""
    return str(_headers(request, (JOB_TOKEN_HEADER,)).get(JOB_TOKEN_HEADER, ""))


# Logged, at WARNING, for a message that is not its job's own (tasks/jobstate.py): its token
# is not the one in the job's record.
FOREIGN = ("a message for job %s that is not the job's own (its token is not the record's: "
           "sent by hand?) was dropped")


class BatchJob(NamedTuple):
    """One job of a batch, as the parent hands it to a child (pickled: a tuple is cheap)."""
    id: str
    args: JobArgs
    trace: dict[str, str]  # its trace id and W3C trace context, where it has them
    token: str = ""  # the job's token as its message carries it (tasks/jobstate.py)
    tag: str = ""  # its message's delivery tag, on the worker's in-flight record

    @classmethod
    def of(cls, request: Any) -> BatchJob:
        """From Celery's `Request` for the job."""
        message = getattr(request, "message", None)
        trace = _headers(request, _CARRIED)  # its trace headers and token in one pass
        token = str(trace.pop(JOB_TOKEN_HEADER, ""))
        return cls(request.id, JobArgs.from_kwargs(request.kwargs), trace, token,
                   getattr(message, "delivery_tag", "") or "")

    @classmethod
    def of_message(cls, headers: Mapping[str, Any], kwargs: Any) -> BatchJob:
        """From a task message still on its queue: its headers and its body's kwargs (a
        reload failing a removed model's queued jobs: scripts/reload_removed.py)."""
        return cls(str(headers["id"]),
                   JobArgs.from_kwargs(kwargs if isinstance(kwargs, dict) else None),
                   {k: str(headers[k]) for k in _TRACE_HEADERS if headers.get(k)},
                   str(headers.get(JOB_TOKEN_HEADER) or ""))

    @property
    def trace_id(self) -> str | None:
        return self.trace.get("trace_id")


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"  # result stored
    FAILED = "failed"  # failure stored
    NOT_RUN = "not_run"  # cancelled, expired, missing or already finished: acknowledge
    RETRY = "retry"  # not run, nothing stored (Redis unavailable): back to the queue
    UNSTORED = "unstored"  # ran, but Redis refused its result: the parent keeps `final` and
    # stores it when Redis takes writes again (running it again would run it twice)


@dataclass(frozen=True)
class JobOutcome:
    job_id: str
    outcome: Outcome
    runtime: float = 0.0
    outputs: int = 0
    error: JobError | None = None
    reason: StartDecision | None = None  # NOT_RUN: why
    model_version: str = ""  # the version of the model that ran it
    final: Final | None = None  # UNSTORED: what to store
    acked: bool = False  # its message is off the in-flight record already (the finish took it)


def succeeded(app: Any, job: BatchJob, outputs: list) -> Final:
    """The job's success: its outputs stored (packed where they can be: the reader encodes
    them as the job asked), with its webhook."""
    return Final(job.id, Status.SUCCEEDED, results.stored(job.id, outputs=outputs), None,
                 webhook_message(app, job, Status.SUCCEEDED), job.token)


def failed(app: Any, job: BatchJob, error: JobError) -> Final:
    return Final(job.id, Status.FAILED, results.stored(job.id, error=error), error,
                 webhook_message(app, job, Status.FAILED), job.token)


def webhook_message(app: Any, job: BatchJob, status: Status) -> QueuedMessage | None:
    """The delivery a job asked for, as a task message `finish` queues with its result. Its
    arguments are the job and the event only: the deliverer reads the URL and the result from
    Redis (tasks/webhooks.py), so no inspector sees them."""
    hook = job.args.webhook
    event = status.value
    if not hook or event not in (hook.get("events") or ()):
        return None
    delivery = {"job_id": job.id, "event": event, "trace_id": job.trace_id}
    return task_message(app, DELIVER_TASK, str(uuid.uuid4()), delivery,
                        queue=WEBHOOK_QUEUE, priority=PRIORITIES["normal"])
