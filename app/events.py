"""GET /v1/jobs/<id>/events: a job's moves as Server-Sent Events (`text/event-stream`), as a
browser's `EventSource` reads them: `queued`, `running`, `progress` (a job spanning several
model calls counts its items done) and the final one, named by the job's final status
(`succeeded`, `failed`, `cancelled`, `expired`); every event's data is the job as GET shows
it. After the final event the stream ends.

A stream is held like `?wait` (app/waiter.py): a greenlet woken by the moves the workers
announce, no thread and no polling, within the same caps: it takes a wait slot (429 when none
is free) and lasts at most `max_wait_s`, then ends; the client reconnects with
`Last-Event-ID`, and an event it has seen is not sent again. A reconnect after the final
event is answered 204, which tells an EventSource to stop. A client that closes its
connection gives its slot back at once (app/hangup.py), not at the next heartbeat's failed
write. A comment line every HEARTBEAT_S keeps proxies from closing a quiet stream. A move
followed at once by the next may be seen only as the next; the final event is never
skipped.
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from typing import Iterator

import orjson
import redis
from flask import Response, request

from app import auth
from app.openapi import LAST_EVENT_ID, REQUEST_ID, Blueprint, errors
from app.errors import TooManyWaits
from app.jobs import caller_job
from app.responses import Job, dump, job_body, no_content
from app.store import Watch
from app.waiter import NoSlot
from config import Settings
from tasks.jobstate import JobRecord, Status

logger = logging.getLogger(__name__)

HEARTBEAT_S = 15.0
RETRY_MS = 1000  # how soon an EventSource reconnects to a stream that ended early
EVENTS = ["queued", "running", "progress", "succeeded", "failed", "cancelled", "expired"]
# Each event of the stream (OpenAPI 3.1: a text/event-stream schema describes one event).
_EVENT = {"type": "object", "required": ["event", "id", "data"], "properties": {
    "event": {"type": "string", "enum": EVENTS},
    "id": {"type": "string", "description": "the move: its event's name, progress-<items done>"},
    "data": {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"$ref": "#/components/schemas/Job"},
             "description": "the job as GET shows it"},
    "retry": {"type": "integer", "description": "milliseconds before reconnecting"}}}
_STREAM = {"description": "the job's moves, one event each, up to its final one",
           "headers": {"X-Request-ID": REQUEST_ID},
           "content": {"text/event-stream": {"schema": _EVENT}}}


def register(bp: Blueprint, settings: Settings, keys: bool) -> None:
    """Add the route to the jobs blueprint."""
    hold_s = settings.max_wait_s

    @bp.get("/jobs/<job_id>/events")
    @bp.doc(summary="Follow a job's moves as Server-Sent Events", operationId="jobEvents",
            parameters=[LAST_EVENT_ID], responses={
                200: _STREAM, 204: {"description": "the final event was sent already: "
                                                       "nothing more will come"}})
    @errors(bp, keys, e404=None, e429="every wait slot is taken (too_many_waits), or the "
            "key's read budget is used up (rate_limited)")
    def job_events(job_id: str):
        canonical, job, store = caller_job(job_id)
        seen = request.headers.get("Last-Event-ID", "")
        if job.terminal and seen == job.status.value:
            return no_content()
        watching = ExitStack()
        peers = auth.current_key() is None  # read here: the stream runs outside the request
        if job.terminal:
            events: Iterator[str] = iter([_frame(job, peers)])
        else:
            try:
                watch = watching.enter_context(
                    store.watch(canonical, auth.current_owner(), moves=True))
            except NoSlot as exc:
                raise TooManyWaits(f"{exc}; read the job without a stream or retry later",
                                   retry_after=1, status=job.status.value) from None
            events = _stream(watch, watching, seen, time.monotonic() + hold_s, peers)
        response = Response(events, mimetype="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        response.call_on_close(watching.close)  # the slot, even if the stream never started
        return response


def _event(job: JobRecord) -> tuple[str, str]:
    """The event a job as it stands is: its name and its id."""
    if job.status is Status.RUNNING and job.items_done:
        return "progress", f"progress-{job.items_done}"
    return job.status.value, job.status.value


def _frame(job: JobRecord, peers: bool) -> str:
    name, ident = _event(job)
    data = orjson.dumps(dump(Job, job_body(job, peers=peers))).decode()
    return f"id: {ident}\nevent: {name}\ndata: {data}\n\n"


def _stream(watch: Watch, watching: ExitStack, seen: str, deadline: float,
            peers: bool) -> Iterator[str]:
    """Each move of the job once, woken by the watch, until its final one or `deadline`."""
    try:
        yield f"retry: {RETRY_MS}\n\n"
        store = watch.store  # the job's Redis group's
        job = store.get(watch.job_id)
        while job is not None:
            if _event(job)[1] != seen:
                seen = _event(job)[1]
                yield _frame(job, peers)
            remaining = deadline - time.monotonic()
            if job.terminal or remaining <= 0:
                return
            # While the listener is away (Redis reconnecting) the job is read every second.
            subscribed = store.waiter.subscribed.is_set()
            woken = watch.finished.wait(min(remaining, HEARTBEAT_S if subscribed else 1.0))
            watch.finished.clear()
            if watch.gone.is_set():  # the client left: its slot goes back now
                return
            if not woken and subscribed and remaining > HEARTBEAT_S:
                yield ": keep-alive\n\n"
            job = store.get(watch.job_id)
    except redis.RedisError as exc:  # the client reconnects, and is told Redis is away
        logger.warning("event stream of job %s ended: Redis unavailable (%s)", watch.job_id, exc)
    finally:
        watching.close()
