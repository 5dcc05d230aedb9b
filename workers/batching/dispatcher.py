"""The worker's dispatcher, in its main process: intake and batching. Every batching task's
requests wait in one buffer per model (workers/batching/policy.py decides when a batch leaves);
each batch goes, as one call, to a free prefork pool child (workers/child/execute.py), and the
next full one to a busy child ahead of time (`batches_ahead`: it waits in the child's pipe,
workers/broker/pool.py `HeldBatches`). How its jobs
then end is the settlement's (workers/batching/settlement.py); the periodic tick is the liveness's
(workers/batching/liveness.py). Celery hands it requests through the task Strategy
(workers/batching/strategy.py).

Each job keeps its Celery identity without a Celery `Request` built for it: it is a `Job`
(workers/batching/job.py) that Celery's books hold, so Celery's own handlers do the bookkeeping
per job: `inspect reserved/active`, task events for Flower (received, started, succeeded/failed
with runtime), revocation, late acks, and requeueing when the child running it dies
(`task_reject_on_worker_lost`); what only a Request answers builds it then.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from time import monotonic
from typing import Any

import redis
from billiard.einfo import ExceptionInfo, ExceptionWithTraceback
from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker import state as worker_state

from config.calibration import calibration_path, effective_batch_size, on_gpu
from config.models import ModelSpec
from tasks.errors import removed_error
from tasks.jobstate import JobState
from tasks.names import PRIORITIES
from tasks.redis_client import connect
from workers.child.batch import FOREIGN, BatchJob, JobOutcome, job_token
from workers.broker import InFlight, Leases, broker_of
from workers.broker.events import send_task_events
from workers.broker.pool import free_children, serving_children
from workers.child.devices import visible_gpu_count
from workers.child.execute import run_batch
from workers.batching.isolation import CrashLoops, TimeLimits
from workers.batching import prefetch
from workers.batching.liveness import Liveness
from workers.batching.policy import Batch, BatchScheduler
from workers.batching.reload import Reloader
from workers.batching.settlement import Settlement
from workers.batching.stopping import StopDeadline

logger = logging.getLogger(__name__)


def _stopping() -> bool:
    # Celery sets these to the exit code, 0 included, when a shutdown starts.
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


@dataclass
class Running:
    """A batch handed to the pool."""
    model: str
    requests: list
    started: float  # monotonic: handed, then taken up by its child
    limit: float  # its time limit (s)
    accepted: bool = False  # taken up by its child (not waiting in its pipe)


#: A batch goes ahead to a busy child this long before the child's batch is due to end: a
#: fixed margin (the parent's round trip, with room for a busy loop), and a share of the
#: batch's usual time (its spread).
AHEAD_MARGIN_S = 0.005
AHEAD_SHARE = 0.25


class PoolDispatcher:
    """One per worker: buffers every batching task's requests and feeds the pool."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.settings = consumer.app.conf.iq_settings
        models = consumer.app.conf.iq_models
        self.scheduler = BatchScheduler()
        self.inflight = 0
        self.connection = consumer.connection
        self.client = connect(self.settings.redis_url, self.settings)
        self.leases = Leases(InFlight(self.client, broker_of(consumer.app)))
        self.limits = TimeLimits({m: spec.time_limit_s for m, spec in models.items()})
        self.crash_loops = CrashLoops()
        self.settlement = Settlement(consumer.app, self.leases, JobState(
            self.client, self.settings.kept_s, self.settings.job_ttl_s), self.limits,
            eventer=lambda: getattr(consumer, "event_dispatcher", None))
        self.liveness = Liveness(consumer, self.client, self.leases, self._idle, self._tick,
                                 self.unhealthy)
        # Batches in the pool, and the job id of every request held (buffered or running).
        self.running: dict[int, Running] = {}
        self.ids: dict[str, Any] = {}
        self.stop_deadline = StopDeadline(self, self.settings.stop_timeout_s)
        self.reloader = Reloader(self, self.client)
        self._timer_entry: Any = None
        self._timer_due: float | None = None
        self._gpu_count: int | None = None
        self._usual: dict[str, float] = {}  # a model's usual batch time (s), smoothed
        self._pump_due = False
        self._received: list[tuple[str, dict]] = []  # task-received events not sent yet
        # The models file and queues the prefetch was last sized for (`fit_prefetch`).
        self._prefetch_for: tuple[dict[str, ModelSpec], frozenset[str]] | None = None

    @property
    def capacity(self) -> int:
        """Children that may hold a batch: all of them, less one being replaced by a reload,
        and no more than those whose models are loaded (not a replacement still loading)."""
        total = int(self.consumer.pool.num_processes or 1) - self.reloader.unavailable
        serving = serving_children(self.consumer.pool)
        return max(total if serving is None else min(total, serving), 0)

    def batch_size(self, spec: ModelSpec) -> int:
        """The model's max batch (config/calibration.py `effective_batch_size`, which the
        child's warm-up and the worker's prefetch take too): on a GPU, unless its entry
        declares one, the calibrator's answer under the token budget; else its
        max_batch_size."""
        size = effective_batch_size(spec, self.settings, on_gpu(spec, self._gpus()))
        if size != spec.max_batch_size:
            logger.info("model %s on a GPU: max batch %d, the calibrator's (%s)", spec.name,
                        size, calibration_path(self.settings))
        return size

    def _gpus(self) -> int:
        if self._gpu_count is None:
            self._gpu_count = visible_gpu_count(self.settings)
        return self._gpu_count

    @property
    def ahead(self) -> int:
        """Batches handed each child beyond the one it runs (`batches_ahead`); none while a
        reload replaces children (a child on the previous file must come to hold none)."""
        return 0 if self.reloader.replacing else self.settings.batches_ahead

    def tick(self) -> None:
        """The worker's periodic tick (`heartbeat_interval_s`)."""
        self.liveness.tick()
        self.reloader.tick()
        self.fit_prefetch()
        self.fit_intake()

    def fit_prefetch(self) -> None:
        """The worker's prefetch sized again (workers/batching/prefetch.py) when the models it
        serves changed since it was last: its models file (a reload) or the queues it
        consumes (`control add_consumer`/`cancel_consumer`, a reload's new queue)."""
        if getattr(self.consumer, "task_consumer", None) is None:
            return  # between connections: its queues are read once it is connected again
        models = self.consumer.app.conf.iq_models
        queues = frozenset(self.liveness.consumed_queues())
        if self._prefetch_for is not None and self._prefetch_for[0] is models \
                and self._prefetch_for[1] == queues:
            return
        self._prefetch_for = (models, queues)
        prefetch.fit_served(self.consumer, self.settings, prefetch.served(models, queues),
                            self._gpus())

    def fit_intake(self, capacity: int | None = None) -> None:
        """While none of its children can serve (each loads its models: a replacement for
        one that died, a reload's, the first ones), this worker fetches nothing, and what
        waits in its buffer goes back to its queue, for another worker to run now rather than
        this one in a model load's time; a job of a lost batch stays, to run alone here
        (workers/batching/isolation.py). It fetches again once a child can serve (`child_ready`, or
        the next tick). `capacity`: as `pump` just read it (reading it asks the pool whether
        each child is alive, a `waitpid` each)."""
        capacity = self.capacity if capacity is None else capacity
        serving = capacity > 0
        state = self.leases.inflight.state
        state.children_busy = serving and self.inflight >= capacity
        if state.fetching != serving:
            state.fetching = serving
            logger.info("a pool child serves: fetching" if serving else
                        "no pool child can serve (models loading): fetching nothing until one can")
        if not serving:
            self.release_buffered("no pool child can serve", keep_alone=True)

    def child_ready(self, _pid: int) -> None:
        """A pool child took up work (its models loaded), on the event loop."""
        if _stopping():
            return
        self.reloader.step()
        self.pump()

    def _idle(self) -> bool:
        """A pool child is free and nothing waits in the buffer."""
        return self.inflight < self.capacity and len(self.scheduler) == 0

    def reset_for(self, connection: Any) -> None:
        """After a broker reconnect: what waited in the buffer goes back to its queue at once
        (another worker may take it); batches still running stay this worker's, and their
        acknowledgements go through its own Redis client."""
        if connection is self.connection:
            return
        self.connection = connection
        self.release_buffered("broker connection replaced")

    def release_buffered(self, why: str, keep_alone: bool = False) -> None:
        self._send_received()
        drained = self.scheduler.drain(keep_alone)
        for pending in drained:
            worker_state.task_ready(pending.job)
        if not drained:
            return
        if self.leases.restore([p.job.message for p in drained]):
            logger.warning("%s: %d buffered job(s) back on their queues", why, len(drained))
        else:
            logger.warning("%s: %d buffered job(s) go back on their queues once Redis "
                           "answers; until then this worker keeps their leases", why,
                           len(drained))

    # -- intake --------------------------------------------------------------------------
    def duplicate(self, request: Any) -> bool:
        """Whether a message for a job this worker holds already is dropped. A copy of the
        message held (the same token: delivered again) is, acknowledged unless it is the very
        message held (then the entry on the in-flight record is the one held: should the held
        one turn out to have lapsed when it starts, the settlement puts that entry back on
        its queue, workers/batching/settlement.py). Of two messages with one job id and different
        tokens, one is not the job's own (sent by hand: Flower's send-task), and the job's record
        tells which: the newcomer is dropped, or the one held if it has not started (one running is
        refused by its start); where the record cannot tell, the newcomer is dropped."""
        held = self.ids.get(request.id)
        if held is None or held is request or not self.leases.holds(held.message):
            return False
        if job_token(held) == job_token(request):
            logger.warning("job %s delivered again while this worker holds it; the copy is "
                           "dropped", request.id)
            if held.message.delivery_tag == request.message.delivery_tag:
                self.leases.forget([request.message])
            else:
                self.leases.ack([request.message])
            return True
        own = self._own_token(request.id)
        if own is not None and own == job_token(request):
            if self.scheduler.remove(held):  # the one held is not the job's own: it goes
                logger.warning(FOREIGN, held.id)
                worker_state.task_ready(held)
                self.leases.ack([held.message])
            return False
        if own is None:
            logger.warning("job %s: a message with another token than the one this worker "
                           "holds, and no token in its record to tell which is the job's own; "
                           "the newcomer is dropped", request.id)
        else:
            logger.warning(FOREIGN, request.id)
        self.leases.ack([request.message])
        return True

    def _own_token(self, job_id: str) -> str | None:
        """The token of the job's own message, from its record; None when it cannot tell."""
        try:
            return self.settlement.state.token_of(job_id)
        except redis.RedisError as exc:
            logger.warning("could not read job %s's token: %s", job_id, exc)
            return None

    def received(self, job_id: str, fields: dict) -> None:
        """A job's `task-received` event (workers/batching/strategy.py), sent with those of the
        rest of its fetch, in one go, before any of them is batched, revoked or failed
        (`_send_received`)."""
        self._received.append((job_id, fields))

    def _send_received(self) -> None:
        if self._received:
            jobs, self._received = self._received, []
            send_task_events(getattr(self.consumer, "event_dispatcher", None),
                             "task-received", jobs)

    def submit(self, model: str, request: Any, alone: bool = False,
               arrived: float | None = None, pump: bool = True) -> None:
        if self.reloader.fails_removed(model):
            self._send_received()
            self.settlement.fail([request], removed_error(model))
            return
        kwargs = request.kwargs or {}
        inputs = kwargs.get("inputs")
        items = len(inputs) if isinstance(inputs, list) else 1
        priority = (request.delivery_info or {}).get("priority")
        worker_state.task_reserved(request)
        self.ids[request.id] = request
        self.scheduler.add(model, request, items, monotonic() if arrived is None else arrived,
                           priority=PRIORITIES["normal"] if priority is None else int(priority),
                           alone=alone)
        if pump:
            self.pump()

    def pump_soon(self) -> None:
        """`pump` once the event loop turns again: after every message of the fetch being
        delivered is in the buffer, so that they form their batches together, at the cost of
        one pump, not one a message. At once where there is no event loop."""
        hub = getattr(self.consumer, "hub", None)
        if hub is None:
            self.pump()
        elif not self._pump_due:
            self._pump_due = True
            hub.call_soon(self._pump_now)

    def _pump_now(self) -> None:
        self._pump_due = False
        self.pump()

    # -- batching ------------------------------------------------------------------------
    def _ahead_due(self) -> list[float]:
        """When each running batch's child should have its next batch: shortly before the
        batch is due to end (its model's usual time, AHEAD_MARGIN_S and AHEAD_SHARE before).
        Handed no earlier, a batch sent ahead is not fixed while a job of higher priority may
        still arrive, for longer than a hand-over's round trip; a model not yet timed, none."""
        due = []
        for r in list(self.running.values()):
            usual = self._usual.get(r.model)
            if r.accepted and usual is not None:
                due.append(r.started + usual * (1 - AHEAD_SHARE) - AHEAD_MARGIN_S)
        return due

    def idle_children(self, capacity: int) -> int:
        """Children free to take a batch now. Its own count (children less batches handed)
        would count none free while one child holds a batch and the next ahead and another
        holds none: a partial batch would wait for a batch to end with a child idle. So,
        where the pool can tell (workers/broker/pool.py `free_children`), the children that
        hold no batch, within the capacity those holding one leave (a reload's child being
        replaced counts in neither)."""
        own = max(capacity - self.inflight, 0)
        pool = free_children(self.consumer.pool)
        if pool is None:
            return own
        free, holding = pool
        return max(own, min(free, capacity - holding))

    def pump(self, freed: int = 0) -> None:
        """Batches to the children: to an idle one what waits (the policy's say); then, to a
        busy one whose batch is about to end (`_ahead_due`), ahead, only a full batch, so that
        no batch is smaller for going ahead (what is not full waits, as before, for a child to
        be free)."""
        self._send_received()
        capacity = self.capacity
        idle = self.idle_children(capacity)
        ahead = max(capacity * (1 + self.ahead) - self.inflight - idle, 0)
        if ahead > 0:
            now = monotonic()
            ending = sum(1 for due in self._ahead_due() if due <= now)
            ahead = min(ahead, max(ending - max(self.inflight - capacity, 0), 0))
        with self.settlement.settling():
            batches = self.scheduler.batches(monotonic(), idle=idle, busy=self.inflight,
                                             freed=min(freed, idle),
                                             discard=self.settlement.revoked)
            if ahead > 0:
                busy = self.inflight + len(batches)
                batches += self.scheduler.batches(monotonic(), idle=ahead, busy=max(busy, 1),
                                                  discard=self.settlement.revoked,
                                                  full_only=True)
        for batch in batches:
            self._apply(batch)
        self._arm_timer(capacity)
        self.fit_intake(capacity)

    def _arm_timer(self, capacity: int | None = None) -> None:
        capacity = self.capacity if capacity is None else capacity
        due = self.scheduler.next_deadline() if self.idle_children(capacity) > 0 else None
        if len(self.scheduler) and self.inflight < capacity * (1 + self.ahead):
            now = monotonic()  # a full batch may go ahead when a child's batch nears its end
            coming = [d for d in self._ahead_due() if d > now]
            if coming:
                due = min(coming) if due is None else min(due, min(coming))
        if due == self._timer_due:
            return
        if self._timer_entry is not None:
            self._timer_entry.cancel()
            self._timer_entry = None
        self._timer_due = due
        if due is not None:
            self._timer_entry = self.consumer.timer.call_after(
                max(due - monotonic(), 0.0), self._on_timer
            )

    def _on_timer(self) -> None:
        self._timer_entry = None
        self._timer_due = None
        self.pump()

    def _apply(self, batch: Batch) -> None:
        """The batch to a free child, as one call; its outcomes come back to `_returned`."""
        requests = [p.job for p in batch.jobs]
        self.inflight += 1
        running = Running(batch.model, requests, monotonic(), self.limits.limit(batch.model))
        self.running[id(running)] = running

        def on_accepted(pid: int, time_accepted: float) -> None:
            running.started = monotonic()  # a batch handed ahead starts when its child is free
            running.accepted = True
            self.settlement.accepted(requests, pid, time_accepted)
            if self.ahead and len(self.scheduler):
                # Its child's next batch is due as this one nears its end (`_ahead_due`): the
                # timer for it, or a child whose batch was handed ahead would wait for the
                # next arrival to be handed its next.
                self._arm_timer()

        def on_return(outcomes: list[JobOutcome]) -> None:
            self.running.pop(id(running), None)
            self._returned(batch.model, requests, outcomes)

        def on_error(exc_info: ExceptionInfo) -> None:
            self.running.pop(id(running), None)
            self._lost(running, exc_info)

        self.consumer.pool.apply_async(
            run_batch,
            args=(batch.model, [BatchJob.of(r) for r in requests],
                  self.leases.inflight.state.inflight_key),
            accept_callback=on_accepted,
            callback=on_return,
            error_callback=on_error,
            # Past the limit the child is killed and replaced; the batch's jobs run again
            # alone, and the one that reaches the limit alone fails with `timeout`.
            timeout=running.limit,
            correlation_id=requests[0].id,
        )

    def _returned(self, model: str, requests: list, outcomes: list[JobOutcome]) -> None:
        self.inflight -= 1
        took = max((o.runtime for o in outcomes), default=0.0)
        self.limits.observe(model, took)
        usual = self._usual.get(model)
        self._usual[model] = took if usual is None else 0.8 * usual + 0.2 * took
        if _stopping():
            # Shutting down: the loop may not turn again, and no new batch starts.
            self.settlement.finish(model, requests, outcomes)
            return
        self.reloader.step()  # a reload takes a child on the previous file before it is reused
        self.pump(freed=1)
        # The pool writes the freed child its next batch only when the event loop next
        # turns. Acknowledging now (a Redis round trip and an event per job) would hold that
        # batch back for all of it, the model idle meanwhile; so the bookkeeping waits a
        # millisecond, past that write (results are stored already).
        self.consumer.timer.call_after(0.001, self.settlement.finish, (model, requests, outcomes))

    def _lost(self, running: Running, exc_info: ExceptionInfo) -> None:
        """The batch call did not return (workers/batching/isolation.py): its jobs run again alone,
        ahead of what arrived since, or fail."""
        self.inflight -= 1
        exc = exc_info.exception
        exc = exc.exc if isinstance(exc, ExceptionWithTraceback) else exc
        stopping = _stopping()
        if isinstance(exc, (WorkerLostError, TimeLimitExceeded)) and not stopping:
            self.crash_loops.lost(running.model)
        again = self.settlement.failed_batch(running.model, running.requests, exc_info,
                                             stopping=stopping)
        for r in again:
            self.submit(running.model, r, alone=True, arrived=running.started)
        if not stopping:
            self.reloader.step()  # its replacement child may be the one a reload waits for
            self.pump(freed=1)

    # -- the tick and the stop -----------------------------------------------------------
    def _tick(self) -> None:
        """Every heartbeat (workers/batching/liveness.py): results Redis refused are stored, and
        the ids of jobs no longer held are forgotten."""
        self.settlement.store_kept()
        for job_id, request in list(self.ids.items()):
            if not self.leases.holds(request.message):
                self.ids.pop(job_id, None)

    def unhealthy(self) -> list[str]:
        """Models whose instances here must not count as live: their children crash-loop, or
        a batch of theirs runs past its time limit (its child not stopped yet)."""
        now = monotonic()
        late = {r.model for r in list(self.running.values()) if now - r.started > r.limit + 5}
        return sorted(late | set(self.crash_loops.models()))

    def running_tags(self) -> list[str]:
        return [r.message.delivery_tag for b in list(self.running.values()) for r in b.requests]
