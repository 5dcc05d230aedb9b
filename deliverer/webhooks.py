"""Webhook delivery: what to deliver (`delivery`, read from the job in Redis), one attempt
(`attempt`, a plain function) and the task that retries it (its steps: `Deliverer`), run by
the deliverer (deliverer.main, `scripts/webhooks.sh`).

The task's arguments are the job id and the event; its task id is the delivery's id
(`webhook-id`, the same on every retry), chosen when the job finished and recorded with its
result. An attempt first claims the job's webhook for this delivery (tasks/jobstate.py: the
event must be the job's terminal status and one it asked for, the id the recorded one, and no
attempt of it answered for good yet); an answer that ends the delivery (delivered, final,
refused, given up) is recorded too. So a delivery sent by hand (Flower's send-task) can make
the deliverer sign neither another event, nor a delivery under an id of its choosing, nor a
copy of one already answered (a copy sent while the real one waits for a retry is still
signed: the receiver's check of seen ids drops it). It reads the
job's record (its webhook URL and owner) and result, and POSTs them signed with the owner's key (tasks/webhooks.py) through
tasks.egress (pinned to the checked address, one deadline for the whole request). Errors, 5xx,
408 and 429 are retried with exponential backoff; any other answer, redirects included, is
final. A host that already has `webhook_host_concurrency` deliveries in flight gets this one
later, without spending a retry: a slow receiver holds a few threads, never all of them. Logs
name the job, the host and the status, never the payload or the URL (which may carry a
receiver's token).

A retry is not a Celery countdown held unacknowledged by the deliverer: it moves, in one step,
from the deliverer's in-flight record to the webhook queue's delayed set, due by Redis's clock
(workers/broker/inflight.py, `later`), and a fetch puts it back on the queue when due. So one
delivery of a job's event exists at every instant, whatever restarts or recovers meanwhile. A
delivery whose attempts are spent is kept in a dead-letter list (tasks.webhooks.DEAD_LETTERS)
and counted (`webhook_given_up_total`).
"""
from __future__ import annotations

import enum
import json
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from celery import Celery

from config import Settings
from tasks import egress
from tasks.jobstate import DeliveryClaim, JobState, Status
from tasks.logs import trace
from tasks.messages import task_message
from tasks.names import PRIORITIES
from tasks.redis_client import connect
from tasks.webhooks import (DEAD_LETTER_CAP, DEAD_LETTERS, DELIVER_TASK, QUEUE, headers,
                            signing_key)
from deliverer import metrics
from workers.broker import InFlight, broker_of

logger = logging.getLogger(__name__)

# A receiver's answer is not read, only its status: a little of the body is enough.
MAX_ANSWER_BYTES = 64 * 1024


class Outcome(enum.Enum):
    DELIVERED = "delivered"  # 2xx
    FINAL = "final"  # an answer that retrying will not change: 3xx, most 4xx
    REFUSED = "refused"  # the URL may not be called (any more)
    BUSY = "busy"  # the host is at its cap: not attempted
    RETRY = "retry"  # an error, a timeout, 5xx, 408 or 429


@dataclass(frozen=True)
class Delivery:
    id: str  # webhook-id: the delivery task's id
    url: str
    owner: str  # the API key's name that owns the job; "" with keys off
    payload: dict[str, Any]


@dataclass(frozen=True)
class Attempt:
    outcome: Outcome
    status: int = 0  # the receiver's status; 0: none
    detail: str = ""


class HostSlots:
    """Deliveries in flight per host, capped; taking a slot never waits."""

    def __init__(self, per_host: int) -> None:
        self.per_host = per_host
        self._lock = threading.Lock()
        self._busy: dict[str, int] = {}

    def take(self, host: str) -> bool:
        with self._lock:
            if self._busy.get(host, 0) >= self.per_host:
                return False
            self._busy[host] = self._busy.get(host, 0) + 1
            return True

    def give_back(self, host: str) -> None:
        with self._lock:
            left = self._busy.pop(host) - 1
            if left:
                self._busy[host] = left


def host_of(url: str) -> str:
    try:
        return (urlsplit(url).hostname or "").lower()
    except ValueError:
        return ""


def classify(status: int) -> Outcome:
    if 200 <= status < 300:
        return Outcome.DELIVERED
    if status >= 500 or status in (408, 429):
        return Outcome.RETRY
    return Outcome.FINAL


def delivery(jobs: JobState, delivery_id: str, job_id: str, event: str) -> Delivery | None:
    """What to POST for `event` of the job, as its record and result stand; None when the
    record is gone (past job_ttl_s) or names no webhook."""
    job = jobs.read(job_id)
    if job is None or not job.webhook_url:
        return None
    payload: dict[str, Any] = {"id": job_id, "model": job.model, "status": event}
    if event == Status.SUCCEEDED.value:
        outputs = job.outputs  # kept result_ttl_s: past it, said so, as GET says it
        payload["result"] = {"outputs": outputs} if outputs is not None else None
        if outputs is None:
            payload["result_expired"] = True
    elif job.error is not None:
        payload["error"] = job.error.to_dict()
    return Delivery(delivery_id, job.webhook_url, job.owner, payload)


_DROPPED = {
    DeliveryClaim.MISSING: "the job's record is gone, or it asked for no webhook",
    DeliveryClaim.NOT_ITS_STATUS: "the event is not the job's status (sent by hand?)",
    DeliveryClaim.NOT_ASKED: "the job did not ask for this event (sent by hand?)",
    DeliveryClaim.DUPLICATE: "not the delivery the job queued (sent by hand?)",
    DeliveryClaim.DONE: "the job's delivery was answered already (sent by hand?)",
}
_ENDS = (Outcome.DELIVERED, Outcome.FINAL, Outcome.REFUSED)


def attempt(what: Delivery, settings: Settings, slots: HostSlots) -> Attempt:
    host = host_of(what.url)
    if not slots.take(host):
        return Attempt(Outcome.BUSY)
    try:
        body = json.dumps(what.payload).encode()
        key = signing_key(settings.webhook_secret, what.owner)
        answer = egress.fetch(what.url, allow=settings.webhook_allow_list, method="POST",
                              body=body, headers=headers(key, what.id, body),
                              deadline_s=settings.webhook_timeout_s,
                              max_bytes=MAX_ANSWER_BYTES)
        status = answer.status
    except egress.Refused as exc:  # checked again: DNS may have changed since the job came
        return Attempt(Outcome.REFUSED, detail=str(exc))
    except egress.TooLarge as exc:
        status = exc.status
    except egress.RequestFailed as exc:
        return Attempt(Outcome.RETRY, detail=str(exc))
    finally:
        slots.give_back(host)
    return Attempt(classify(status), status)


def dead_letter(client: Any, what: Delivery, event: str, attempts: int, last: Attempt) -> None:
    """Keep a delivery whose attempts are spent (newest first, the last DEAD_LETTER_CAP)."""
    entry = {"delivery": what.id, "job_id": what.payload["id"], "event": event,
             "host": host_of(what.url), "attempts": attempts,
             "last": last.status or last.detail, "at": time.time()}
    with client.pipeline(transaction=False) as pipe:
        pipe.lpush(DEAD_LETTERS, json.dumps(entry))
        pipe.ltrim(DEAD_LETTERS, 0, DEAD_LETTER_CAP - 1)
        pipe.execute()


class Deliverer:
    """What the delivery task does, over the deliverer's own Redis client: claim the job's
    delivery, make one attempt, then settle its outcome (recorded, logged, retried later or
    given up)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.settings: Settings = app.conf.iq_settings
        self.slots = HostSlots(self.settings.webhook_host_concurrency)
        self.client = connect(self.settings.redis_url, self.settings)
        self.jobs = JobState(self.client)
        self.metrics = metrics.get()
        self._inflight: InFlight | None = None  # the worker's Broker's, once it started

    def deliver(self, task: Any, job_id: str, event: str, trace_id: str | None) -> None:
        """One run of the delivery task `task` (its request: the delivery's id, retries)."""
        claim = self.jobs.claim_delivery(job_id, event, task.request.id)
        if claim is not DeliveryClaim.DELIVER:
            logger.warning("webhook %s for job %s dropped: %s", event, job_id, _DROPPED[claim])
            return
        what = delivery(self.jobs, task.request.id, job_id, event)
        if what is None:
            logger.warning("webhook %s for job %s dropped: the job's record is gone", event,
                           job_id)
            return
        started = time.monotonic()
        result = attempt(what, self.settings, self.slots)
        self.metrics.attempts.labels(result.outcome.value).inc()
        if result.outcome is not Outcome.BUSY:
            self.metrics.attempt_seconds.observe(time.monotonic() - started)
        self.settle(task, job_id, event, trace_id, what, result)

    def settle(self, task: Any, job_id: str, event: str, trace_id: str | None,
               what: Delivery, result: Attempt) -> None:
        """Record an answer that ends the delivery, say what became of it, and send it again
        later (a busy host, a retry) or keep it as given up."""
        settings, host, tries = self.settings, host_of(what.url), task.request.retries
        if result.outcome in _ENDS or (result.outcome is Outcome.RETRY
                                       and tries >= settings.webhook_retries):
            self.jobs.delivery_done(job_id, task.request.id, result.outcome.value)
        if result.outcome is Outcome.DELIVERED:
            logger.info("webhook %s for job %s delivered to %s (%d)", event, job_id, host,
                        result.status)
        elif result.outcome is Outcome.REFUSED:
            logger.warning("webhook for job %s to %s refused: %s", job_id, host, result.detail)
        elif result.outcome is Outcome.FINAL:
            logger.warning("webhook for job %s: %s answered %d; not retried", job_id, host,
                           result.status)
        elif result.outcome is Outcome.BUSY:
            # Later, with the same retry count; jittered so that waiting deliveries do not
            # come back all at once.
            delay = settings.webhook_backoff_s * random.uniform(0.5, 1.5)
            self.later(task, job_id, event, trace_id, delay, tries)
            logger.debug("webhook for job %s: %s is busy; again in %.1fs", job_id, host, delay)
        elif tries >= settings.webhook_retries:
            self.metrics.given_up.inc()
            dead_letter(self.client, what, event, tries + 1, result)
            logger.error("webhook for job %s to %s given up after %d attempts; last: %s "
                         "(kept in %s)", job_id, host, tries + 1,
                         result.status or result.detail, DEAD_LETTERS)
        else:
            countdown = settings.webhook_backoff_s * (2 ** tries)
            logger.info("webhook for job %s: %s answered %s; retry %d in %.1fs", job_id,
                        host, result.status or result.detail, tries + 1, countdown)
            self.later(task, job_id, event, trace_id, countdown, tries + 1)

    def later(self, task: Any, job_id: str, event: str, trace_id: str | None, delay: float,
              retries: int) -> None:
        """This delivery again in `delay` seconds (`retries`: its count of retries then)."""
        if self._inflight is None:  # the worker's Broker, installed once the deliverer started
            self._inflight = InFlight(self.client, broker_of(self.app))
        again = task_message(self.app, DELIVER_TASK, task.request.id,
                             {"job_id": job_id, "event": event, "trace_id": trace_id},
                             queue=QUEUE, priority=PRIORITIES["normal"], retries=retries)
        tag = (task.request.properties or {}).get("delivery_tag", "")
        if not self._inflight.later(tag, delay, QUEUE, again.list_key, again.payload):
            logger.warning("webhook for job %s: its delivery was taken back by another "
                           "deliverer meanwhile; its retry is that one's", job_id)


def register(app: Celery) -> None:
    """The delivery task, bound to a Deliverer made now (in the deliverer's process)."""
    deliverer = Deliverer(app)

    @app.task(name=DELIVER_TASK, bind=True, acks_late=True, ignore_result=True,
              max_retries=deliverer.settings.webhook_retries, shared=False)
    def deliver(self, job_id: str, event: str, trace_id: str | None = None) -> None:
        with trace(trace_id):
            deliverer.deliver(self, job_id, event, trace_id)
