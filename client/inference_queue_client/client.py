"""The client: submit, wait, get, list, follow, cancel, retry, delete, with the retries every
user of the API needs.

* 429 and 503 are retried after their `Retry-After` (0: at once, but never sooner than
  half a second after the try began); a dropped connection or a timeout after an
  exponential backoff. Each call gives up after `retry_for` seconds of failing (counted
  from the first failure, so a long wait is not cut short by a blip near its end).
* Every submit carries an `Idempotency-Key` (one is made when the caller gives none), so a
  submit resent after a dropped connection returns the job the first one created.
* `wait` holds the request on the API (`?wait=`, and `Prefer: wait` on a submit) rather than
  polling; a poll that comes back early (a proxy cutting it short) backs off.
* Ctrl-C (KeyboardInterrupt) while waiting cancels the job, then propagates.
* `events` follows a job's Server-Sent Events, reconnecting as a browser's EventSource does.
"""
from __future__ import annotations

import json
import logging
import os
import random
import time
import uuid
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

import requests

from inference_queue_client import environment
from inference_queue_client.errors import (APIError, Conflict, ConnectionFailed,
                                           InvalidRequest, IQError, Overloaded, RateLimited,
                                           Unavailable, WaitTimeout, api_error)
from inference_queue_client.jobs import Job
from inference_queue_client.sse import read_events

T = TypeVar("T")

logger = logging.getLogger("inference_queue_client")

DEFAULT_URL = "http://127.0.0.1:8000"  # without IQ_API_URL and IQ_PORT (environment.py)
RETRIED = (Overloaded, RateLimited, Unavailable)
MIN_RETRY_INTERVAL_S = 0.5  # from a try's start to the next's after a 429 or 503
# What a dropped or silent connection raises; the request may or may not have arrived.
DROPPED = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


class JobEvent(NamedTuple):
    """One event of a job's stream: what happened (`queued`, `running`, `progress`, or its
    final status) and the job as it then stood."""
    event: str
    job: Job


# The API's event streams send a comment at least this often while a job is quiet.
HEARTBEAT_S = 15.0


def backoff(attempt: int, first: float = 0.5, cap: float = 10.0) -> float:
    """Exponential backoff with full jitter: spreads out clients that failed together."""
    return random.uniform(0, min(cap, first * 2 ** attempt))


class Client:
    """A client of one inference-queue API. Not shared between threads: make one per thread.

    `url` defaults to the environment's IQ_API_URL, else http://127.0.0.1:<IQ_PORT> (the port
    `make run` gives the API), else DEFAULT_URL; `api_key` to IQ_API_KEY. A misspelling of one
    of those variables raises ConfigurationError, naming the closest. `timeout` is
    the connect and read timeout of one request beyond the time the API is asked to hold it;
    `max_wait` the longest hold asked of the API (its IQ_MAX_WAIT_S, 30 by default)."""

    def __init__(self, url: str | None = None, *, api_key: str | None = None,
                 timeout: float = 10.0, retry_for: float = 60.0, max_wait: float = 30.0,
                 session: requests.Session | None = None) -> None:
        self.url = (url or environment.api_url(os.environ)).rstrip("/")
        self.timeout = timeout
        self.retry_for = retry_for
        self.max_wait = max_wait
        self.session = session or requests.Session()
        api_key = api_key if api_key is not None else environment.api_key(os.environ)
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.session.close()

    # -- the API's operations ----------------------------------------------------------------
    def submit(self, model: str, inputs: list[Any], *, options: dict[str, Any] | None = None,
               priority: str | None = None, timeout_s: float | None = None,
               webhook: dict[str, Any] | None = None, encoding_format: str | None = None,
               idempotency_key: str | None = None, trace_id: str | None = None,
               wait: float | None = None, cancel_on_interrupt: bool = True) -> Job:
        """Submit a job. With `wait`, the API holds the request up to that many seconds
        (`Prefer: wait`) and answers with the finished job if it finished by then."""
        body: dict[str, Any] = {"model": model, "inputs": inputs}
        optional = {"options": options, "priority": priority, "timeout_s": timeout_s,
                    "webhook": webhook, "encoding_format": encoding_format}
        body.update({k: v for k, v in optional.items() if v is not None})
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        if trace_id:
            headers["X-Request-ID"] = trace_id
        hold = min(wait, self.max_wait) if wait else 0.0
        logger.info("submitting a job of %d input(s) to %s", len(inputs), model)
        held = {**headers, "Prefer": f"wait={hold:g}"} if hold else headers
        try:
            answer = self._call("POST", "/v1/jobs", body=body, headers=held, hold=hold)
        except KeyboardInterrupt:
            if hold and cancel_on_interrupt:
                # The job's id is not known yet, but its Idempotency-Key names it.
                self._quietly(lambda: self.cancel(self._once(
                    "POST", "/v1/jobs", data=_json_body(body), headers=headers)["id"]))
            raise
        return Job(answer, encoding_format)

    def get(self, job: Job | str, *, encoding_format: str | None = None) -> Job:
        """The job as it stands."""
        job_id, encoding_format = _ident(job, encoding_format)
        return Job(self._call("GET", f"/v1/jobs/{job_id}"), encoding_format)

    def wait(self, job: Job | str, *, timeout: float | None = None,
             encoding_format: str | None = None, cancel_on_interrupt: bool = True) -> Job:
        """The job once it is finished (any terminal status). WaitTimeout after `timeout`
        seconds (None: no limit); Ctrl-C cancels the job unless `cancel_on_interrupt` is
        False."""
        job_id, encoding_format = _ident(job, encoding_format)
        logger.info("waiting for job %s", job_id)
        try:
            for current in self._polls(job_id, timeout, encoding_format):
                if current.terminal:
                    return current
            raise WaitTimeout(current, timeout or 0.0)
        except KeyboardInterrupt:
            if cancel_on_interrupt:
                self._quietly(lambda: self.cancel(job_id))
            raise

    def cancel(self, job: Job | str) -> Job:
        """Cancel a queued job: it ends `cancelled` and never runs. Conflict when it is
        already running or finished (`job_status` says which)."""
        job_id, encoding_format = _ident(job, None)
        try:
            return Job(self._call("POST", f"/v1/jobs/{job_id}/cancel"), encoding_format)
        except Conflict as exc:
            if exc.job_status == "cancelled":  # a resent cancel: the first one went through
                return self.get(job_id)
            raise

    def retry(self, job: Job | str) -> Job:
        """A new job with the inputs and options of `job`, which failed, was cancelled or
        expired (its request is kept IQ_KEPT_INPUTS_TTL_S). A job retried already gives the
        job that retried it: a resent retry makes no second job. Conflict when it cannot be
        retried (the message says why)."""
        job_id, encoding_format = _ident(job, None)
        try:
            return Job(self._call("POST", f"/v1/jobs/{job_id}/retry"), encoding_format)
        except Conflict as exc:
            if exc.retried_as:
                return self.get(exc.retried_as, encoding_format=encoding_format)
            raise

    def delete(self, job: Job | str) -> None:
        """Delete a finished job, its result and its kept request; Conflict while it is
        queued (cancel it first) or running (delete it once it finishes)."""
        job_id, _ = _ident(job, None)
        self._call("DELETE", f"/v1/jobs/{job_id}")

    def jobs(self, *, status: str | None = None, model: str | None = None,
             page_size: int = 100) -> Iterator[Job]:
        """Your jobs (your API key's), newest first, without their outputs, a page (one
        request) at a time: `status="failed"` is the dead-letter view."""
        query = {k: v for k, v in (("status", status), ("model", model)) if v}
        cursor = None
        while True:
            page = self._call("GET", "/v1/jobs", params={**query, "limit": str(page_size),
                                                         **({"cursor": cursor} if cursor
                                                            else {})})
            yield from (Job(body) for body in page["jobs"])
            cursor = page["next_cursor"]
            if not cursor:
                return

    def events(self, job: Job | str, *, timeout: float | None = None,
               encoding_format: str | None = None) -> Iterator[JobEvent]:
        """The job's moves as they happen (Server-Sent Events), up to and including its
        final one; a stream the API ends early (it holds one at most max_wait_s) is taken up
        again where it stopped (Last-Event-ID), as a browser's EventSource does. WaitTimeout
        once `timeout` seconds have passed without the final event."""
        job_id, encoding_format = _ident(job, encoding_format)
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: str | None = None
        current: Job | None = None
        while True:
            response = self._retrying("GET", f"/v1/jobs/{job_id}/events",
                                      lambda: self._open_stream(job_id, seen, deadline))
            try:
                if response.status_code == 204:  # the final event was seen already
                    return
                for sent in read_events(response.iter_lines(decode_unicode=True)):
                    seen = sent.id or seen
                    current = Job(json.loads(sent.text), encoding_format)
                    yield JobEvent(sent.event, current)
                    if current.terminal:
                        return
            except (requests.ConnectionError, requests.Timeout,
                    requests.exceptions.ChunkedEncodingError):
                pass  # cut off, or silent past its heartbeat: taken up again below
            finally:
                response.close()
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(current or self.get(job_id), timeout or 0.0)

    def _open_stream(self, job_id: str, seen: str | None,
                     deadline: float | None) -> requests.Response:
        headers = {"Accept": "text/event-stream", **({"Last-Event-ID": seen} if seen else {})}
        # Past a heartbeat's silence the stream is taken for lost; never past the deadline.
        silence = self.timeout + HEARTBEAT_S
        if deadline is not None:
            silence = max(min(silence, deadline - time.monotonic()), 0.1)
        response = self.session.get(f"{self.url}/v1/jobs/{job_id}/events", headers=headers,
                                    stream=True, timeout=(self.timeout, silence))
        if response.status_code >= 400:
            try:
                payload: Any = response.json()
            except ValueError:
                payload = response.text
            response.close()
            raise api_error(response.status_code, payload, response.headers.get("Retry-After"))
        return response

    def run(self, model: str, inputs: list[Any], *, timeout: float | None = None,
            **submit: Any) -> list[Any]:
        """Submit, wait, and return the outputs: JobFailed unless the job succeeded."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.submit(model, inputs, wait=self.max_wait if timeout is None
                          else min(timeout, self.max_wait), **submit)
        if not job.terminal:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            job = self.wait(job, timeout=remaining)
        return job.result()

    # -- waiting -------------------------------------------------------------------------------
    def _polls(self, job_id: str, timeout: float | None,
               encoding_format: str | None) -> Iterator[Job]:
        """The job after each long poll, until `timeout` has passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        early = 0
        while True:
            remaining = self.max_wait if deadline is None else deadline - time.monotonic()
            hold = max(min(self.max_wait, remaining), 0.1)
            asked = time.monotonic()
            current = Job(self._call("GET", f"/v1/jobs/{job_id}",
                                     params={"wait": f"{hold:g}"}, hold=hold), encoding_format)
            yield current
            if deadline is not None and time.monotonic() >= deadline:
                return
            if time.monotonic() - asked < hold / 2:  # cut short: do not poll in a tight loop
                early += 1
                time.sleep(min(backoff(early), max(remaining, 0.0)))
            else:
                early = 0

    # -- one call, with its retries -----------------------------------------------------------
    def _call(self, method: str, path: str, *, body: Any = None,
              params: dict[str, str] | None = None, headers: dict[str, str] | None = None,
              hold: float = 0.0) -> Any:
        data = _json_body(body) if body is not None else None
        return self._retrying(method, path, lambda: self._once(
            method, path, data=data, params=params, headers=headers, hold=hold))

    def _retrying(self, method: str, path: str, attempt: Callable[[], T]) -> T:
        """`attempt` until it succeeds, through 429 and 503 (after their Retry-After) and
        dropped connections (after a backoff), for `retry_for` seconds of failing."""
        failing_since: float | None = None
        tries = 0
        while True:
            tried = time.monotonic()
            try:
                return attempt()
            except RETRIED as exc:
                failure: Exception = exc
                delay = exc.retry_after if exc.retry_after is not None else backoff(tries)
                # `Retry-After: 0` (a submit Redis left unanswered: the try itself waited) is
                # resent at once; a quick answer is not resent in a tight loop, whatever it says.
                delay = max(delay, MIN_RETRY_INTERVAL_S - (time.monotonic() - tried))
            except DROPPED as exc:
                failure, delay = exc, backoff(tries)
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since + delay > self.retry_for:
                if isinstance(failure, APIError):
                    raise failure
                raise ConnectionFailed(f"{method} {self.url}{path}: {failure}") from failure
            tries += 1
            logger.warning("%s %s: %s; retrying in %.1fs", method, path,
                           _describe(failure), delay)
            time.sleep(delay)

    def _once(self, method: str, path: str, *, data: bytes | None = None,
              params: dict[str, str] | None = None, headers: dict[str, str] | None = None,
              hold: float = 0.0) -> Any:
        if data is not None:
            headers = {**(headers or {}), "Content-Type": "application/json"}
        response = self.session.request(method, self.url + path, data=data, params=params,
                                        headers=headers,
                                        timeout=(self.timeout, self.timeout + hold))
        try:
            payload: Any = response.json()
        except ValueError:
            payload = response.text
        if response.status_code >= 400:
            raise api_error(response.status_code, payload, response.headers.get("Retry-After"))
        return payload

    def _quietly(self, action: Any) -> None:
        """One best-effort attempt (cancelling on the way out of a Ctrl-C): nothing it
        raises, and no retry, may hold up the interrupt."""
        saved, self.retry_for = self.retry_for, 0.0
        try:
            action()
        except (IQError, requests.RequestException) as exc:
            logger.warning("could not cancel on interrupt: %s", exc)
        finally:
            self.retry_for = saved


def _ident(job: Job | str, encoding_format: str | None) -> tuple[str, str | None]:
    if isinstance(job, Job):
        return job.id, encoding_format or job.encoding_format
    return job, encoding_format


def _json_body(body: Any) -> bytes:
    """A request's body as JSON, which has no NaN nor infinity: a value it cannot carry is
    the caller's mistake, said before anything is sent."""
    try:
        return json.dumps(body, allow_nan=False).encode()
    except ValueError as exc:
        raise InvalidRequest(f"the request cannot be sent as JSON: {exc} (JSON has no NaN "
                             "nor infinity)") from None
    except TypeError as exc:
        raise InvalidRequest(f"the request cannot be sent as JSON: {exc}") from None


def _describe(failure: Exception) -> str:
    if isinstance(failure, APIError):
        return f"{failure.http_status} {failure.code}"
    return f"connection failed ({type(failure).__name__})"
