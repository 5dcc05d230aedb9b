"""The decision on a submitted job, apart from HTTP. The view (app/jobs.py) reads the request,
calls `Submitter.submit` and turns its answer into a response; each refusal is an APIError
(app/errors.py maps them to HTTP). The checks run cheapest first, so that a bad or unwanted
request costs little:

1. the key's rate limit, before the body is read or validated;
2. the body against its model's schema (app/schemas.py: lengths before items);
3. the key's right to the model, the Idempotency-Key's form;
4. the webhook URL (a DNS lookup) and image inputs (URL fetches, decoding in a decoder
   process: app/decoder_pool.py);
5. the atomic submit (tasks/jobstate.py): a full queue, an Idempotency-Key reused, a retry
   of a job that succeeded or was retried already.

A retry (`Submitter.retry`) goes through the same checks with the request its job kept.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable, Mapping

import orjson
import redis
from marshmallow import ValidationError

from app import auth, images
from app.decoder_pool import DecoderPool, DecodersBusy
from app.errors import (Conflict, KeptRequestsFull, RateLimited, TooManyJobs, Unavailable,
                        ValidationFailed)
from app.metrics import ApiMetrics
from app.schemas import IDEMPOTENCY_KEY_PATTERN, flatten, job_schema, validate_job
from app.group_stores import Stores, group_name
from config import Settings
from config.job_ids import new_job_id
from config.models import ModelSpec
from tasks import egress, redis_deadline, webhooks
from tasks.jobstate import (IdempotencyMismatch, JobRecord, KeptFull, NotReplicated,
                            Overloaded, StoreFull)

logger = logging.getLogger(__name__)

_IDEMPOTENCY_KEY = re.compile(IDEMPOTENCY_KEY_PATTERN)


@dataclass(frozen=True)
class Caller:
    """Who submits: their API key (None when keys are off), the request's trace id and its
    Idempotency-Key header, as sent."""
    key: auth.ApiKey | None
    trace_id: str
    idempotency_key: str | None = None

    @property
    def owner(self) -> str:
        return self.key.name if self.key else ""


@dataclass(frozen=True)
class Accepted:
    job: JobRecord
    spec: ModelSpec
    created: bool  # False: an earlier job of the same Idempotency-Key


class Submitter:
    def __init__(self, settings: Settings, models: Mapping[str, ModelSpec], store: Stores,
                 metrics: ApiMetrics) -> None:
        self.settings, self.models, self.store, self.metrics = settings, models, store, metrics
        self.schemas = {name: job_schema(spec) for name, spec in models.items()}
        self.decoders = DecoderPool(settings.image_decoders, settings.image_decode_timeout_s,
                                    settings.image_decode_memory_mb,
                                    settings.decoders_per_key)  # started on first use

    def _refused(self, model: str, reason: str) -> None:
        self.metrics.rejected.labels(model if model in self.models else "unknown", reason).inc()

    def submit(self, caller: Caller, read_body: Callable[[], object],
               before_queue: Callable[[str], str] | None = None) -> Accepted:
        """Check and queue one job; `read_body` gives the request's body as a job dict (or
        whatever JSON was sent) and is called only once the key's rate allows.
        `before_queue` is called with the new job's id (which says its model's Redis group)
        once every check has passed, just before the job is recorded and queued; what it
        returns is the reply channel the job's finish is to announce it on ("": none)."""
        self._take_token(caller)
        # Reading the client's body, looking its webhook up and fetching its images have
        # bounds of their own: they do not count against the request's Redis deadline.
        with redis_deadline.paused():
            body = read_body()
        spec, job = self._validated(body)
        self._check_caller(caller, spec)
        if job["webhook"]:
            self._check_webhook(job["webhook"])
        if spec.input_type == "image":  # decoded, checked and resized before it is queued
            with redis_deadline.paused():
                job["inputs"] = self._canonical_images(spec, job["inputs"], caller)
        return self._queue(caller, spec, job, before_queue=before_queue)

    def retry(self, caller: Caller, job: JobRecord, request: str | bytes) -> Accepted:
        """A new job with the kept `request` of `job` (one that did not succeed), linked to
        it. The checks of a submit, but its inputs are as they were queued (images already
        decoded): the key's rate, the schema (the model may have changed since), the key's
        right to the model, the webhook."""
        self._take_token(caller)
        spec, again = self._validated(orjson.loads(request))
        self._check_caller(caller, spec)
        if again["webhook"]:
            self._check_webhook(again["webhook"])
        return self._queue(caller, spec, again, retry_of=job.id)

    def _take_token(self, caller: Caller) -> None:
        try:
            auth.check_rate(self.store.redis, caller.key)
        except RateLimited:
            self._refused("unknown", "rate_limited")
            raise

    def _validated(self, data: object) -> tuple[ModelSpec, dict]:
        try:
            return validate_job(data, self.models, self.schemas)
        except ValidationError as exc:
            model = data.get("model") if isinstance(data, dict) else None
            self._refused(model if isinstance(model, str) else "unknown", "validation")
            raise ValidationFailed("the job is invalid", fields=flatten(exc.messages)) from None

    def _check_caller(self, caller: Caller, spec: ModelSpec) -> None:
        auth.check_model(caller.key, spec.name)
        key = caller.idempotency_key
        if key is not None and not _IDEMPOTENCY_KEY.match(key):
            raise ValidationFailed("invalid header", fields={
                "Idempotency-Key": ["1 to 255 visible ASCII characters"]})

    def _canonical_images(self, spec: ModelSpec, inputs: list, caller: Caller) -> list[str]:
        try:
            return images.canonical_inputs(spec, inputs, self.settings, self.decoders,
                                           caller.owner or None)
        except images.BadImages as exc:
            self._refused(spec.name, "validation")
            raise ValidationFailed("the job is invalid", fields=exc.fields) from None
        except DecodersBusy:
            self._refused(spec.name, "decoders_busy")
            raise Unavailable("every image decoder of this API process is busy; retry "
                              "later", retry_after=1) from None

    def _queue(self, caller: Caller, spec: ModelSpec, job: dict,
               before_queue: Callable[[str], str] | None = None,
               retry_of: str = "") -> Accepted:
        """The atomic submit; each refusal as its APIError (a retry's own, RetryRefused, is
        the caller's to answer)."""
        store, job_id, key = self.store.for_model(spec), new_job_id(spec.redis), \
            caller.idempotency_key
        ran_on = self.store.for_job(retry_of) if retry_of else None
        if retry_of and (ran_on is None or ran_on[1] is not store):
            # A retry is linked to its job in one script, on one Redis.
            raise Conflict(f"the job's model {spec.name} has moved to "
                           f"{group_name(spec.redis)} since the job ran: submit it anew")
        reply = before_queue(job_id) if before_queue is not None else ""
        try:
            submitted, created = store.submit(spec, job, caller.trace_id, key,
                                              owner=caller.owner, job_id=job_id,
                                              retry_of=retry_of, reply=reply)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._refused(spec.name, "store_unavailable")
            raise self._unsure(job_id, key, exc, spec.redis) from None
        except NotReplicated as exc:
            self._refused(spec.name, "not_replicated")
            raise Unavailable(
                f"job {job_id} is recorded on the primary and will run, but {exc.acked} of "
                f"{exc.wanted} replica(s) confirmed it within "
                f"{self.settings.redis_wait_timeout_s:g}s: a failover could lose it; resend "
                "with the same Idempotency-Key to wait for the copy again",
                retry_after=2, job_id=job_id) from None
        except Overloaded:
            self._refused(spec.name, "queue_full")
            raise TooManyJobs(f"the queue of {spec.name} is full "
                              f"({spec.max_queue_depth} jobs); retry later",
                              retry_after=1) from None
        except KeptFull as exc:
            self._refused(spec.name, "kept_full")
            raise self._kept_full(exc) from None
        except IdempotencyMismatch:
            raise Conflict("this Idempotency-Key was used with a different request "
                           "body") from None
        except StoreFull as exc:
            self._refused(spec.name, "store_full")
            raise Unavailable(f"the job store is nearly full ({exc}); retry later",
                              retry_after=30) from None
        if created:
            self.metrics.submitted_job(spec.name)
            logger.debug("job %s accepted: model=%s inputs=%d priority=%s", submitted.id,
                         spec.name, len(job["inputs"]), job["priority"])
        return Accepted(submitted, spec, created)

    def _kept_full(self, exc: KeptFull) -> KeptRequestsFull:
        """429 for a key whose kept requests are at its quota. Retry-After: when the first of
        them leaves Redis, at most a minute (a waiting job's leaves once it succeeds, which
        may be any moment)."""
        return KeptRequestsFull(
            f"the requests Redis keeps for this API key (its waiting jobs', and those of jobs "
            f"that did not succeed, kept {self.settings.kept_s}s for a retry) hold {exc.held} "
            f"of its {exc.quota} bytes (kept_bytes_per_key); DELETE /v1/jobs/<id> of finished "
            "jobs frees theirs, or retry later", retry_after=max(1, min(exc.wait_s, 60)))

    def _unsure(self, job_id: str, key: str | None, exc: Exception,
                group: str = "") -> Unavailable:
        """503 for a submit whose fate Redis did not tell in time: the script may have run
        (it was sent, and Redis may run it once it resumes), so the answer names the job
        and the way to find it again without making a second one; the resend is safe.

        Retry-After 0 when Redis took the command and did not answer (a timeout: frozen, or
        the network silent): this attempt already waited the whole deadline, and each resend
        is bounded by it too, so resending at once is no tight loop, and a submit that
        arrived as Redis froze gets its id as soon as it resumes instead of a second later
        (in the game day's 5 s freeze, the arrivals of its first 2 s got theirs after more
        than 5 s). Retry-After 1 for a refused or dropped connection, as for any unreachable
        Redis (app/errors.py): a restarted Redis is back within seconds. The answer names the
        model's Redis group when it has one."""
        logger.warning("submit of job %s unanswered by Redis: %s", job_id, exc)
        again = "resend with the same Idempotency-Key: it returns this job, never a second" \
            if key else "send an Idempotency-Key with each submit, so that a resend returns " \
                        "the job instead of making a second one"
        store = f"the job store ({group_name(group)})" if group else "the job store (Redis)"
        return Unavailable(
            f"{store} did not answer within {self.settings.redis_deadline_s:g}s; "
            f"job {job_id} may have been recorded and may run: {again}, or read "
            f"/v1/jobs/{job_id} (404: it was not recorded)",
            retry_after=0 if isinstance(exc, redis.TimeoutError) else 1, job_id=job_id)

    def _check_webhook(self, hook: dict) -> None:
        """422 for a webhook this service will not call. While webhooks are off (no secret)
        the answer is a 422 on `webhook`, not a 503: retrying will not help, and the job can
        be sent without the field and polled."""
        if not webhooks.accepted(self.settings.webhook_secret, self.settings.webhooks_enabled):
            raise ValidationFailed("the job is invalid",
                                   fields={"webhook": [webhooks.SECRET_MISSING]})
        try:
            with redis_deadline.paused():  # a DNS lookup, with its own timeout
                egress.check_url(hook["url"], allow=self.settings.webhook_allow_list)
        except egress.NotPublic as exc:
            raise ValidationFailed("the job is invalid", fields={"webhook.url": [
                f"{exc}; IQ_WEBHOOK_ALLOW lists the hosts and CIDRs allowed all the "
                "same"]}) from None
        except (egress.Refused, ValueError) as exc:
            raise ValidationFailed("the job is invalid",
                                   fields={"webhook.url": [str(exc)]}) from None
