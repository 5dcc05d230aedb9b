"""A job as the worker's main process holds it: `Job`, the few fields a batch needs (its id,
task, headers read once, decoded body, message), not a Celery `Request` built a message.

Celery's books hold the `Job` itself (`worker_state.requests`, `reserved_requests`,
`active_requests`), so its own remote-control commands (`inspect reserved`, `active`,
`query_task`, `revoke`, `stats`) find it under Celery's names; what they ask of it that a
`Job` does not answer (`info`, `terminate`, `send_event`, `on_success` on a failure...) goes
to the job's Celery `Request`, built then, once, from the same message (`Job.request`). The
common path, a job fetched, batched, run and succeeded, builds none: its events are sent from
the `Job` (workers/broker/events.py `send_task_events`), its acknowledgement goes through the
worker's leases, a batch's together (workers/batching/settlement.py).

A message that asks for more of Celery than a batch needs (an `eta`, an `expires`, a time
limit, a `shadow` name, protocol 1, a body the worker did not decode itself) gets its Request
at once, at intake: its reading and its refusals are Celery's, as before."""
from __future__ import annotations

from typing import Any, Callable

from celery.exceptions import InvalidTaskError
from celery.worker import state as worker_state
from celery.worker.request import Request

#: A message's `timelimit` that asks nothing of Celery's Request (`Job.light`).
_NO_LIMITS = (None, [None, None], (None, None))


class SummaryRequest(Request):
    """A job's Celery request, which shows inspectors what its task events show: the
    message's argsrepr and kwargsrepr (the job's summary, tasks/messages.py), never the
    arguments themselves. Celery's own `info` gives the real kwargs, the job's inputs, to
    `inspect reserved`, `query_task` and `active` (Flower's worker page among them).
    `built` counts those this process made (`celery inspect stats`: `iq.requests_built`)."""

    built = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        SummaryRequest.built += 1

    def info(self, safe: bool = False) -> dict[str, Any]:
        return super().info(safe=True)


class Job:
    """One job held by the worker's main process. `make(job)` builds its Celery Request (the
    strategy's: the message, the body and headers as decoded, the job's `eventer`, and what
    it fixes); `settle(message, requeue)` acknowledges or requeues its message (the
    settlement's). What Celery sets on a reserved or active request (`eventer`,
    `acknowledged`, `worker_pid`, `time_start`) is set on the job, and handed to its Request
    before anything asks the Request (`_lend`); `acknowledged` comes back after (`_take_back`).
    `expires`: None unless the Request was built at intake (then its own)."""

    __slots__ = ("message", "id", "name", "headers", "kwargs", "body", "task", "_make",
                 "_settle", "_request", "acknowledged", "worker_pid", "time_start",
                 "eventer", "expires", "__weakref__")

    def __init__(self, message: Any, headers: dict, body: Any, task: Any, eventer: Any,
                 make: Callable[[Job], Request], settle: Callable[[Any, bool], None]) -> None:
        self.message = message
        self.eventer = eventer
        self.headers = headers
        self.body = body
        self.task = task
        self._make = make
        self._settle = settle
        self._request: Request | None = None
        self.acknowledged = False
        self.worker_pid: int | None = None
        self.time_start: float | None = None
        self.expires: Any = None
        try:
            self.id = headers["id"]
            self.name = headers["task"]
            _args, self.kwargs, _embed = body
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidTaskError(f"unreadable task message: {exc!r}") from exc

    @classmethod
    def light(cls, headers: dict) -> bool:
        """Whether a protocol 2 message with these headers may go without its Request: none
        of those only Celery's Request reads as they must be read (an `eta`, an `expires`, a
        `shadow` name, a time limit) is set."""
        get = headers.get
        return not (get("eta") or get("expires") or get("shadow")) and \
            get("timelimit") in _NO_LIMITS

    # -- the Request, built where something asks for it ---------------------------------
    @property
    def request(self) -> Request:
        request = self._request
        if request is None:
            request = self._request = self._make(self)
            self._lend()
        return request

    def _lend(self) -> None:
        """What Celery and the settlement set on the job, onto its Request."""
        request = self._request
        if request is not None:
            request.acknowledged = request.acknowledged or self.acknowledged
            request.worker_pid, request.time_start = self.worker_pid, self.time_start
            request.eventer = self.eventer

    def _take_back(self) -> None:
        request = self._request
        if request is not None:
            self.acknowledged = request.acknowledged

    def __getattr__(self, name: str) -> Any:
        """What only Celery's Request answers (`info`, `revoked`, `terminate`, `send_event`,
        `on_success`, `reject`, ...). A call that ends the job in Celery's books (its
        `task_ready`, which takes it off them by id) takes this Job off them too."""
        if name.startswith("__") or name in Job.__slots__:  # not set yet
            raise AttributeError(name)
        request = self.request
        self._lend()
        found = getattr(request, name)
        if not callable(found):
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            self._lend()
            try:
                return found(*args, **kwargs)
            finally:
                self._take_back()
                self._sync_books()
        return call

    def _sync_books(self) -> None:
        if worker_state.requests.get(self.id) is not self:
            worker_state.reserved_requests.discard(self)
            worker_state.active_requests.discard(self)

    # -- what a batch reads ---------------------------------------------------------------
    @property
    def request_dict(self) -> dict:
        """The job's headers (BatchJob.of reads its trace and token from them)."""
        return self.headers if self._request is None else self._request.request_dict

    @property
    def delivery_info(self) -> dict:
        return {"priority": (self.message.properties or {}).get("priority")}

    @property
    def argsrepr(self) -> str:
        return self.headers.get("argsrepr", "")

    @property
    def kwargsrepr(self) -> str:
        return self.headers.get("kwargsrepr", "")

    @property
    def root_id(self) -> Any:
        return self.headers.get("root_id")

    @property
    def parent_id(self) -> Any:
        return self.headers.get("parent_id")

    def revoked(self) -> bool:
        """`Request.revoked`: False at once for a job with no Request, whose id is not
        revoked and whose message has no stamps (what could revoke it: an expiry, a revoke
        by id or by stamped header); else Celery's, through the Request."""
        if self._request is None and self.id not in worker_state.revoked and \
                not self.headers.get("stamped_headers"):
            return False
        return bool(self.__getattr__("revoked")())

    def acknowledge(self) -> None:
        """What `Request.acknowledge` does, through the settlement's `settle`."""
        if self._request is not None:
            self.__getattr__("acknowledge")()
        elif not self.acknowledged:
            self._settle(self.message, False)
            self.acknowledged = True

    def __repr__(self) -> str:
        return f"<Job: {self.name}[{self.id}]>"
