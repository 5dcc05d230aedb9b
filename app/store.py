"""Jobs as the API sees them: submitted through the job state's atomic script (record and
queued message in one step), read back from the job record. Never imports torch or a model
handler."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterable, Iterator

import orjson
import redis
from celery import Celery

from app import hangup
from app.errors import Unavailable
from app.gauge import Gauge
from app.waiter import NoSlot, ResultWaiter, Slots
from config import Settings
from config.job_ids import new_job_id, token_text
from config.models import ModelSpec
from tasks import redis_deadline, tracing
from tasks.jobstate import CancelOutcome, JobRecord, JobState, Page, Status, new_job
from tasks.keys import idempotency_key, versions_key
from tasks.messages import JOB_TOKEN_HEADER, JobArgs, task_message
from tasks.presence import Presence
from tasks.queuemoves import QueueMoves
from tasks.names import PRIORITIES, queue_lists, task_name
from tasks.redis_client import connect

logger = logging.getLogger(__name__)


class WaitRefused(Exception):
    """No wait slot was free for a job that has not finished; `job` is the job as it stands."""

    def __init__(self, reason: str, job: JobRecord) -> None:
        super().__init__(reason)
        self.job = job


# Index entries one page of GET /v1/jobs reads at most, whatever the filters: its cost is
# bounded; a page that stops there before it is full still has a cursor to go on from.
SCAN_BUDGET = 500
DEAD_STATUSES = frozenset({Status.FAILED.value, Status.CANCELLED.value, Status.EXPIRED.value})


def page_reads(*, status: str = "", model: str = "", limit: int = 20) -> int:
    """The index entries a page of one Redis reads at most (the list script's budget, and
    what the listing is charged: app/group_stores.py's Stores.scan_cost, so that they cannot
    drift): `limit` unfiltered; SCAN_BUDGET with any filter, a dead-letter status included
    (that index holds all three: a page of one reads past the others)."""
    return min(limit, SCAN_BUDGET) if not status and not model else SCAN_BUDGET

# Redis connections one API process opens at most; requests beyond wait for one (each round
# trip is well under a millisecond). The result listener holds one for good.
REDIS_CONNECTIONS = 64


def api_client(settings: Settings, decode: bool = True) -> redis.Redis:
    """An API process's client of its Redis (settings.redis_url): every call on a request's
    path bounded (redis_deadline_s), so that a frozen or unreachable Redis is answered with 503
    in seconds, never waited out; up to REDIS_CONNECTIONS connections, more callers waiting.
    `decode`=False: replies left as bytes."""
    return connect(settings.redis_url, settings, decode=decode,
                   max_connections=REDIS_CONNECTIONS, deadline_s=settings.redis_deadline_s)


def group_name(group: str) -> str:
    """How answers and logs name a group: `Redis group 'name'`, or REDIS_URL's Redis."""
    return f"Redis group {group!r}" if group else "the default Redis (REDIS_URL)"


_CANONICAL = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def parse_job_id(raw: str) -> str | None:
    """Canonical job id, or None when `raw` cannot be one we issued (no Redis lookup needed).
    An id already canonical (every id the API gives out) is itself, without a `uuid.UUID`
    built (~2 µs, at each watch and read of a job); any other goes through one."""
    if _CANONICAL.fullmatch(raw):
        return raw
    try:
        return str(uuid.UUID(raw)) if len(raw) == 36 else None
    except ValueError:
        return None


class Watch:
    """A watch on one job (JobStore.watch), started by its `with` block: `finished` is set when
    the job ends (its Event from the result listener), `gone` (and `finished` too) when the
    client of the request that watches has gone (app/hangup.py): the wait ends there. A class,
    not a generator's context manager over the listener's own (~5 calls fewer a wait, issue
    40)."""

    def __init__(self, store: JobStore, job_id: str, owner: str, moves: bool = False) -> None:
        self.store, self.job_id = store, job_id
        self._watching = store.waiter.watch(job_id, owner, moves)
        self._client: hangup.Hangup | None = None

    def __enter__(self) -> Watch:
        self.finished = self._watching.__enter__()
        try:
            self._client = hangup.watch(self.finished)
        except BaseException:
            self._watching.__exit__(None, None, None)
            raise
        self.gone = self._client.gone
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._client is not None:
                self._client.stop()
        finally:
            self._watching.__exit__(*exc)

    @property
    def reply(self) -> str:
        """The channel the job's finish is to announce it on for this watch (`submit`'s
        `reply`): its store's listener's ("": none)."""
        return self.store.waiter.reply_channel or ""

    def until_terminal(self, job: JobRecord | None, deadline: float) -> JobRecord | None:
        """From `job` as last read (or written), the job once it is terminal or at
        `deadline` (time.monotonic()), reading it again only when woken, and not at all when
        its finish announced it on the listener's reply channel. While the listener is away
        (Redis reconnecting) the job is read every second, and once more when it is back."""
        subscribed = self.store.waiter.subscribed
        while job is not None and not job.terminal and not self.gone.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            with redis_deadline.paused():  # the wait asked for is not the request's Redis time
                self.finished.wait(remaining if subscribed.is_set() else min(remaining, 1.0))
            self.finished.clear()
            announced = self.store.waiter.answer(self.job_id)
            if announced is not None:
                job = announced
                continue
            with self.store.answering():
                job = self.store.get(self.job_id)
        return job


def ready_first() -> Callable[[], None] | None:
    """Under gunicorn's gevent worker (threading patched): `gevent.sleep(0)`, the greenlets
    already runnable run, so that the requests of a burst the event loop has read reach their
    submit and join the first one's group (tasks/group_commit.py's `gather`); it waits on no
    I/O and no clock. Else (threads, a script): None."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None or not monkey.is_module_patched("threading"):
        return None
    import gevent

    return functools.partial(gevent.sleep, 0)


class JobStore:
    def __init__(self, settings: Settings, celery: Celery, models: dict[str, ModelSpec],
                 slots: Slots | None = None, group: str = "") -> None:
        """`models`: those whose queues and jobs are on this Redis (`group`'s: "" is
        REDIS_URL's); `slots`: wait slots shared with the stores of other groups."""
        self.settings, self.group = settings, group
        self.celery = celery
        self.models = models
        # Every queue the API serves, for the gauge's reading (one covers them all).
        self.queues = sorted({model.queue for model in models.values()})
        self.redis = api_client(settings)
        self.state = JobState(self.redis, settings.kept_s, settings.job_ttl_s,
                              group_submits=True, gather_submits=ready_first())
        wanted = settings.wait_replicas
        self.replicas = (wanted, settings.redis_wait_timeout_s) if wanted else None
        self.presence = Presence(self.redis)
        self.moves = QueueMoves(self.redis)
        # Its own client, which leaves replies as bytes: the reply channel carries results.
        self.waiter = ResultWaiter(api_client(settings, decode=False),
                                   settings.max_waits, settings.max_waits_per_key, slots)
        self.gauge = Gauge(self.redis, settings.redis_memory_headroom)

    @contextmanager
    def answering(self) -> Iterator[None]:
        """The block's calls answer a request: when the Redis of a named group does not
        answer (within the request's deadline) or cannot be reached, a 503 naming the group,
        with Retry-After (docs/deploying.md: a group down). REDIS_URL's own errors are
        left to app/errors.py, as without groups."""
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if not self.group:
                raise
            logger.warning("%s unavailable: %s", group_name(self.group), exc)
            said = f"did not answer within {self.settings.redis_deadline_s:g}s" \
                if isinstance(exc, redis.TimeoutError) else "is unreachable"
            raise Unavailable(f"the job store ({group_name(self.group)}) {said}; retry later",
                              retry_after=1) from None

    def queue_depths(self) -> dict[str, int]:
        """Messages waiting for each model's queue, in one round trip: on its lists, and on
        those of a queue a reload took the model off, not moved yet (tasks/queuemoves.py)."""
        depths = self.moves.waiting(spec.queue for spec in self.models.values())
        return {spec.name: depths[spec.queue] for spec in self.models.values()}

    def owned_by(self, job_id: str, owner: str) -> bool:
        """Whether `owner` (an API key's name; "" when keys are off) may see the job. A job
        of another key is reported as missing, not forbidden: ids do not leak."""
        return (self.state.owner_of(job_id) or "") == owner

    def submit(self, spec: ModelSpec, job: dict, trace_id: str,
               idempotency_key_: str | None = None, owner: str = "",
               job_id: str | None = None, retry_of: str = "",
               reply: str = "") -> tuple[JobRecord, bool]:
        """Record and queue a job, atomically (tasks/jobstate.py), under `job_id` (a new id by
        default), as a retry of job `retry_of` if given; `reply`: the reply channel its finish
        is to announce it on (a watch's, Watch.reply). Returns (job, created); with an
        Idempotency-Key seen before, the earlier job and False. Raises Overloaded,
        IdempotencyMismatch, StoreFull, RetryRefused or NotReplicated (fewer replicas than
        `redis_wait_replicas` confirmed the job in time)."""
        hook = job.get("webhook")
        record = new_job(job_id or new_job_id(self.group), model=spec.name, trace_id=trace_id,
                         inputs=len(job["inputs"]), priority=job["priority"], owner=owner,
                         encoding_format=job.get("encoding_format", "float"),
                         webhook_url=hook["url"] if hook else "",
                         webhook_events=hook["events"] if hook else (),
                         token=token_text(6), retry_of=retry_of)
        # The webhook's URL is kept in the record only (tasks/webhooks.py), not in the message.
        args = JobArgs(job["inputs"], job["options"], time.time(),
                       {"events": hook["events"]} if hook else None)
        summary = None if self.settings.events_full_args else {
            "model": spec.name, "inputs": record.inputs, "trace_id": trace_id}
        # The token in the record and the message: only this message can run the job.
        headers = {"trace_id": trace_id, JOB_TOKEN_HEADER: record.token}
        tracing.inject(headers)  # the W3C trace context, when traces are on
        message = task_message(self.celery, task_name(spec.name), record.id, args.kwargs(),
                               queue=spec.queue, priority=PRIORITIES[job["priority"]],
                               headers=headers, summary=summary)
        idempotency = None
        if idempotency_key_:
            digest = hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()
            idempotency = (idempotency_key(owner, idempotency_key_), digest)
        # The depth and the memory are checked only near their limits (app/gauge.py).
        max_depth, headroom = self.gauge.limits(spec, self.queues)
        request = orjson.dumps(job)
        submitted = self.state.submit(
            record, message, depth_lists=queue_lists(spec.queue), max_depth=max_depth,
            ttl_s=self.settings.job_ttl_s, timeout_s=job.get("timeout_s") or spec.timeout_s or 0,
            idempotency=idempotency, memory_headroom=headroom, request=self._kept(request),
            replicas=self.replicas, size=len(request),
            kept_quota=(self.settings.kept_bytes_per_key or None) if owner else None,
            reply=reply)
        if submitted.created:
            return record, True
        earlier = self.state.read(submitted.job_id)
        if earlier is None:  # its record ran out (job_ttl_s) at that very moment
            earlier = replace(record, id=submitted.job_id, status=Status.EXPIRED)
        return earlier, False

    def _kept(self, request: bytes) -> bytes:
        """The request to keep for a retry, should the job not succeed (the job as validated,
        images as queued), when retries are on and it is small enough; else nothing. Kept or
        not, its size counts against its key's quota while the job waits."""
        if self.settings.kept_s <= 0:
            return b""
        return request if len(request) <= self.settings.kept_inputs_max_bytes else b""

    def cancel(self, job_id: str) -> CancelOutcome:
        outcome = self.state.cancel(job_id)
        if outcome is CancelOutcome.CANCELLED:
            # Workers holding it in their buffer drop it at once rather than at its start
            # (which refuses it anyway). The broadcast goes through kombu, whose publish
            # retries know no deadline: it leaves on its own thread (a greenlet under
            # gevent), so that a stalled Redis cannot hold the answer.
            threading.Thread(target=self._revoke, args=(job_id,), name="iq-revoke",
                             daemon=True).start()
        return outcome

    def _revoke(self, job_id: str) -> None:
        try:
            self.celery.control.revoke(job_id)
        except Exception as exc:  # noqa: BLE001 - best effort: the job never starts anyway
            logger.warning("could not broadcast the revoke of job %s: %s", job_id, exc)

    def page(self, owner: str, *, status: str = "", model: str = "",
             cursor: tuple[str, str] | None = None, limit: int = 20) -> Page:
        """A page of the owner's jobs, newest first. Jobs that did not succeed are listed from
        their own index (the dead-letter view), which holds nothing else: a filter on one of
        those statuses reads no job that succeeded. It reads at most `page_reads` index
        entries a page."""
        return self.state.page(owner, dead=status in DEAD_STATUSES, status=status, model=model,
                               cursor=cursor, limit=limit,
                               budget=page_reads(status=status, model=model, limit=limit))

    def delete(self, job_id: str, owner: str) -> str:
        """"deleted", "missing", or the status of a job of `owner`'s not finished yet."""
        return self.state.delete(job_id, owner)

    def kept_request(self, job_id: str) -> str | bytes | None:
        return self.state.kept_request(job_id)

    def get(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        """The job, or None when there is none; with `owner`, also None when it is another
        key's job (as if it did not exist: ids do not leak)."""
        job = self.state.read(job_id)
        if job is None or (owner is not None and job.owner != owner):
            return None
        return job

    def watch(self, job_id: str, owner: str, moves: bool = False) -> Watch:
        """A watch on the job's finish (with `moves`, on its every move) for its `with` block's
        life, taking a wait slot of `owner`'s (raises NoSlot when none is free), given back as
        soon as the request's client goes (app/hangup.py). Started before a
        job is submitted, it needs no read before waiting: a finish after it started cannot be
        missed."""
        return Watch(self, job_id, owner, moves)

    def wait(self, job_id: str, timeout_s: float, owner: str) -> JobRecord | None:
        """The job once it is terminal or `timeout_s` has passed; None at once when there is
        no such job of `owner`'s. Woken by the job's done channel rather than by polling;
        the watch starts before the first read, so a finish in between is not missed. Raises
        WaitRefused, at once, when the job is not finished and every wait slot (of the
        process or of `owner`) is taken."""
        deadline = time.monotonic() + timeout_s
        try:
            with self.watch(job_id, owner) as watch:
                # The listener's subscription, waited for on the request's Redis time.
                self.waiter.subscribed.wait(redis_deadline.bound(
                    min(timeout_s, self.settings.redis_deadline_s)))
                return watch.until_terminal(self.get(job_id, owner), deadline)
        except NoSlot as exc:
            job = self.get(job_id, owner)
            if job is None or job.terminal:
                return job
            raise WaitRefused(str(exc), job) from None

    def live(self, models: Iterable[str]) -> dict[str, dict]:
        """Live model instances per model: pool children with the model loaded (their
        heartbeats) in workers consuming the model's queue (their event loop's tick) that do
        not say the model is unhealthy there, all by Redis's clock (tasks/presence.py); and
        which versions they serve (two during a reload's rollout)."""
        names = list(models)
        live = self.presence.live({name: self.models[name].queue for name in names},
                                  self.settings.heartbeat_ttl_s)
        with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hgetall(versions_key(name))
            versions = pipe.execute()
        return {name: _serving(live[name]["members"], found)
                for name, found in zip(names, versions)}

    def ping(self) -> bool:
        return bool(self.redis.ping())


def _serving(members: list[str], versions: dict[str, str]) -> dict:
    """A model's live pool children (`hostname/index`) counted as /readyz and /v1/models show
    them, in all and per version."""
    by_version: dict[str, list[str]] = {}
    for member in members:
        by_version.setdefault(versions.get(member, "unknown"), []).append(member)
    return {"workers": len({m.rsplit("/", 1)[0] for m in members}), "instances": len(members),
            "versions": [{"version": version, "workers": len({m.rsplit("/", 1)[0] for m in ms}),
                          "instances": len(ms)} for version, ms in sorted(by_version.items())]}
