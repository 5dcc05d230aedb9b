"""A worker's side of a models-file reload (scripts/reload.py announces one): the main process
takes the new file (new models' tasks and queues, new batching limits, removed models' jobs
failed with `model_removed`), then replaces its pool children one at a time, each after the
batch it holds: a spawned child loads the models file its main process hands it
(workers/child/pinned.py), from then on the new one, so the new child loads the new models. The
worker keeps serving from its other children. Its last serving child goes only once a child on
the new file serves beside it: the pool grows by one (a surge, `IQ_RELOAD_SURGE`), the new
child loads the new file, and the old one stops after its batch with the pool shrunk back; a
surge child that cannot load exits and the old child never stopped serving. Without a surge,
its last serving child goes only in its turn (workers/batching/turns.py): the workers that serve
the same queues take turns, so that another keeps serving while this one's new child loads. Where
it stands is written to Redis (tasks/keys.py RELOAD_STATUS_KEY) for the reload command to wait on.

A new child that cannot load the new file records that in Redis and exits
(tasks/reload_failures.py): the rolling update halts there. Its worker, and any other worker
still reloading to that revision (one waiting for its turn), rolls back: the previous file
pinned and applied again, its children started on the new file replaced, the revision
refused; a worker that has not begun it refuses it. The fleet keeps serving the old models.
The pool asks before it starts a child in place of one that exited
(`Reloader.before_children_start`): a failure recorded by then is rolled back first, so that
the next child is started on the previous file, not on the failed one again.

    serving ──(announced revision ≠ its own)──▶ reloading ──(every child replaced)──▶ serving
                 │ its file is not the announced one,       │ a child (its own or another
                 │ does not parse, or failed to load        │ worker's) failed to load it:
                 ▼                                          │ rolled back
              refused (keeps serving the models it has) ◀───┘
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import orjson
import redis

from config import ConfigError
from config.groups import check_model_groups
from config.models import ModelSpec, parse_models, read_models_content, revision_of
from tasks.errors import JobError, removed_error
from tasks.keys import (MODELS_ANNOUNCEMENTS_KEY, MODELS_REVISION_KEY, RELOAD_STATUS_KEY,
                        live_key, versions_key)
from tasks.names import task_name
from tasks.queuemoves import QueueMoves, changed_queues
from workers.broker.pool import (before_children_start, end_surge, ready_children,
                                  retire_idle_child, surge)
from tasks.reload_failures import describe, failure_of
from tasks.serves import capabilities
from workers.child.devices import visible_gpu_count
from workers.batching.isolation import TimeLimits
from workers.batching.model_tasks import register_model
from workers.batching.policy import BatchScheduler
from workers.child.pinned import pin, pinned_content
from workers.batching.turns import Turn

logger = logging.getLogger(__name__)

# How often, while children are being replaced, the worker looks whether the next can go.
STEP_S = 0.25


@runtime_checkable
class QueuesConsumed(Protocol):
    def consumed_queues(self) -> list[str]: ...


@runtime_checkable
class Failing(Protocol):
    def fail(self, requests: list, error: JobError) -> None: ...


@runtime_checkable
class ReloadHost(Protocol):
    """What a reload needs of its worker's dispatcher (workers/batching/dispatcher.py), which
    hands itself in: Celery's consumer (its app, pool, strategies, queues), the buffers and
    the time limits the new file changes, the queues consumed, the settlement that fails a
    removed model's jobs, and the dispatcher's own pump, intake and prefetch."""

    @property
    def consumer(self) -> Any: ...  # Celery's consumer

    @property
    def scheduler(self) -> BatchScheduler: ...

    @property
    def limits(self) -> TimeLimits: ...

    @property
    def liveness(self) -> QueuesConsumed: ...

    @property
    def settlement(self) -> Failing: ...

    def pump(self) -> None: ...

    def batch_size(self, spec: ModelSpec) -> int: ...

    def fit_intake(self) -> None: ...

    def fit_prefetch(self) -> None: ...


class Reloader:
    """One per worker (`PoolDispatcher.reloader`). `dispatcher`: its PoolDispatcher."""

    def __init__(self, dispatcher: ReloadHost, client: redis.Redis) -> None:
        self.dispatcher = dispatcher
        self.consumer = dispatcher.consumer
        self.app = self.consumer.app
        self.client = client
        self.revision: str = self.app.conf.iq_models_revision
        self.state = "serving"
        self.started = time.time()  # a reload tells a worker started again from one beside
        self.error = ""
        self.refused_revision = ""
        # The count of announcements when it refused (tasks/keys.py MODELS_ANNOUNCEMENTS_KEY),
        # and when the reload in progress was announced: announced again, it begins again.
        self.refused_number: str | None = None
        self.announcement: str | None = None
        self.stale: set[int] = set()  # children still on the previous file
        self.retiring: int | None = None
        self.before_retiring: set[int] = set()
        # A surge: the pids before the pool grew by one, while its child loads; then the
        # pool is one child over its size until a child on the previous file stops.
        self.surge_before: set[int] | None = None
        self.shrink_next = False
        self.removed: dict[str, ModelSpec] = {}
        # Removed by the reload in progress: their jobs wait in the buffer (the old children
        # still serve them, the API still accepts them) until every child is on the new file,
        # then fail `model_removed`; a rollback serves them again, none failed.
        self.removing: set[str] = set()
        # What the worker served before the reload in progress, to roll back to:
        # (revision, file content, models); and its children then.
        self.previous: tuple[str, bytes, dict[str, ModelSpec]] | None = None
        self.begun_with: set[int] = set()
        self.content = pinned_content() or b""
        self.app.conf.iq_removed_models = self.removed  # for Liveness: still its queues
        self._timer: Any = None
        self.gpus: int | None = None
        settings = self.app.conf.iq_settings
        self.turn = Turn(client, self.consumer.hostname, settings.heartbeat_ttl_s, STEP_S)
        self.moves = QueueMoves(client)
        self.surges: bool = settings.reload_surge
        self.hooked = False

    @property
    def unavailable(self) -> int:
        """Children out of service for the reload: one stopping, or its replacement loading."""
        return 1 if self.retiring is not None else 0

    @property
    def replacing(self) -> bool:
        """Whether children on the previous file are being replaced (the dispatcher hands no
        batch ahead meanwhile: each of them must come to hold none to be stopped)."""
        return bool(self.stale) or self.retiring is not None or self.surge_before is not None

    # -- the tick ------------------------------------------------------------------------
    def tick(self) -> None:
        """From the worker's tick: start a reload when one was announced, say where it
        stands."""
        if not self.hooked:  # once the pool has started
            self.hooked = before_children_start(self.consumer.pool, self.before_children_start)
        try:
            announced, number = self.client.mget(MODELS_REVISION_KEY, MODELS_ANNOUNCEMENTS_KEY)
        except redis.RedisError:
            return
        if self._newer(announced, number):
            self.begin(announced, number)
        elif announced == self.revision and self.state == "refused" and not self.stale \
                and self.retiring is None:
            # The revision it serves announced again (make reload's undo of a failed load):
            # serving it, as every process is told to.
            self.state, self.error = "serving", ""
        self.watch()
        self.turn.renew()
        self.move_queued()
        self.report()

    def move_queued(self) -> None:
        """What waits on a queue a reload took its model off goes to the model's new queue,
        once no worker consumes the old one (tasks/queuemoves.py)."""
        try:
            moved = self.moves.move(self.app.conf.iq_settings.heartbeat_ttl_s)
        except redis.RedisError as exc:
            logger.warning("could not move the jobs of a renamed queue: %s", exc)
            return
        for m in moved:
            if m.jobs:
                logger.info("%d job(s) waiting on queue %s moved to its model's new queue %s",
                            m.jobs, m.old, m.new)

    def _newer(self, announced: str | None, number: str | None) -> bool:
        """Whether the announced revision is one to begin: not the one it serves, nor one it
        refused unless announced again since."""
        again = announced == self.refused_revision and number != self.refused_number
        return bool(announced) and announced != self.revision and (
            announced != self.refused_revision or again)

    def fails_removed(self, model: str) -> bool:
        """Whether a job of `model` fails with `model_removed`: only when the file this worker
        serves removed it and the newest announced revision has not been begun. A newer one
        (a removal rolled back, which the API processes may serve already and accept the
        model's jobs for) is begun here and now, not at the next tick: the job is then
        judged by it. One read of Redis, for a removed model's jobs only."""
        if model not in self.removed or model in self.removing:
            return False
        try:
            announced, number = self.client.mget(MODELS_REVISION_KEY, MODELS_ANNOUNCEMENTS_KEY)
        except redis.RedisError:
            return True  # failing it needs Redis too: the settlement keeps it meanwhile
        if self._newer(announced, number):
            logger.info("a job of %s, which this worker's models file removed: revision %s "
                        "is announced, taken up now", model, announced)
            self.begin(announced, number)
        return model in self.removed

    def begin(self, revision: str, number: str | None = None) -> None:
        """Reload to the announced `revision` (`number`: the count of its announcements).
        The revision a reload in progress began from, announced again (`make reload`'s undo of
        a failed load, which may come before this worker looked at the failure, or an
        operator's), is gone back to, not reloaded: the children it began with serve it
        already, and none is replaced (a needless surge child loaded it once, issue 37)."""
        if self.state == "reloading" and self.previous is not None \
                and revision == self.previous[0]:
            self.roll_back(failure_of(self.client, self.revision), undone=True)
            return
        self.announcement = number
        path = self.app.conf.iq_settings.models_file
        try:
            content = read_models_content(path)
            specs, found = parse_models(Path(path), content), revision_of(content)
            if found != revision:
                raise ConfigError(f"{path} has revision {found}, not the announced {revision}: "
                                  "this host's models file is not the one the reload checked")
            failure = failure_of(self.client, revision)
            if failure:  # another worker's child could not load it: the roll halted there
                raise ConfigError(describe(revision, failure))
            # What would stop every new child before it loads (make reload checks it against
            # this worker's report; here too, for a reload that did not).
            check_model_groups(specs, self.app.conf.iq_settings.redis_group_urls)
        except ConfigError as exc:
            self.refused_revision, self.error, self.state = revision, str(exc), "refused"
            self.refused_number = number
            logger.error("reload to models file revision %s refused; still serving %s: %s",
                         revision, self.revision, exc)
            return
        previous, self.revision = self.revision, revision
        self.previous = (previous, self.content, self.app.conf.iq_models)
        self.refused_revision, self.error, self.state = "", "", "reloading"
        # The children started from now on load this file (workers/child/pinned.py), as a reload's.
        self.content = content
        pin(content, reload_from=previous)
        gaining = self.apply(specs)
        self.stale, self.begun_with = self._pids(), self._pids()
        self._hold(gaining)
        logger.info("reloading models file %s (revision %s → %s): %d child(ren) to replace, "
                    "one at a time", path, previous, revision, len(self.stale))
        if self._timer is None:
            self._timer = self.consumer.timer.call_repeatedly(STEP_S, self.watch)
        self.step()

    # -- a failed load: back to the previous file ----------------------------------------
    def watch(self) -> None:
        """While reloading (the STEP_S timer, the tick): roll back if a child, this worker's
        or another's, could not load the new file; else the next step."""
        if self.state == "reloading" and self.previous is not None:
            failure = failure_of(self.client, self.revision)
            if failure:
                self.roll_back(failure)
        self.step()

    def before_children_start(self) -> None:
        """From the pool, before it starts children in place of those that exited: a failure
        of the reload in progress recorded by then (most often by the child that just exited)
        is rolled back now, so that the next child is started on the previous file. Without
        this, a child the pool starts before the next STEP_S loaded the failed file again."""
        if self.state == "reloading" and self.previous is not None:
            failure = failure_of(self.client, self.revision)
            if failure:
                self.roll_back(failure)

    def roll_back(self, failure: dict | None, undone: bool = False) -> None:
        """The previous file pinned and applied again; the children started since `begin`
        (on the new file) are replaced; the revision refused from now on. A child billiard
        starts meanwhile on the new file fails and records it again, harmlessly. `failure`:
        the failed load that halted the roll (None: `undone`, the previous revision announced
        again with none recorded)."""
        failed, (revision, content, specs) = self.revision, self.previous
        self.revision, self.content, self.previous = revision, content, None
        pin(content)  # not a reload's: it is what this worker served
        gaining = self.apply(specs, "the rollback")
        stopped: set[int] = set()
        if self.surge_before is not None:
            if ready_children(self.consumer.pool) - self.surge_before:
                self.shrink_next = True  # it serves: it goes after its batch, as stale
            else:  # still loading (or gone): the pool back to its size, the child stopped
                stopped = end_surge(self.consumer.pool, self.surge_before)
            self.surge_before = None
        self.stale = self._pids() - self.begun_with - stopped
        self._hold(gaining)
        self.refused_revision, self.state = failed, "refused"
        self.refused_number = self.announcement
        why = describe(failed, failure) if failure else \
            f"revision {revision} announced again before every child took revision {failed}"
        self.error = f"{why}; rolled back to revision {revision}"
        logger.error("reload to models file revision %s rolled back%s: %s; %d child(ren) "
                     "started on it to replace", failed,
                     f" (revision {revision} announced again)" if undone else "", self.error,
                     len(self.stale))
        self.report()

    # -- the main process's own models ---------------------------------------------------
    def apply(self, specs: dict[str, ModelSpec], by: str = "the reload") -> set[str]:
        """The new models file in this main process: what the dispatcher and the settlement
        read (batching limits, time limits), the new models' tasks and queues, the removed
        models' jobs failed, the moved queues recorded. Children started from now on load the
        new models. Returns the models it gains (its children so far lack them)."""
        old = self.app.conf.iq_models
        self.app.conf.iq_models = specs
        moves = changed_queues({n: m.queue for n, m in old.items()},
                               {n: m.queue for n, m in specs.items()})
        try:
            self.moves.record(moves, [spec.queue for spec in specs.values()])
        except redis.RedisError as exc:  # `make reload` records them once done
            logger.warning("could not record the queues moved by %s: %s", by, exc)
        scheduler = self.dispatcher.scheduler
        for name, spec in specs.items():
            self.removed.pop(name, None)
            self.removing.discard(name)
            self.dispatcher.limits.declared[name] = spec.time_limit_s
            if name in old or task_name(name) in self.app.tasks:
                scheduler.add_model(name, self.dispatcher.batch_size(spec),
                                    spec.max_wait_ms / 1000.0)
            else:
                task = register_model(self.app, name)
                self.consumer.strategies[task.name] = task.start_strategy(self.app,
                                                                          self.consumer)
            if getattr(self.app.conf, "iq_consumes_all", False):
                consumed = set(self.dispatcher.liveness.consumed_queues())
                if spec.queue not in consumed:
                    self.consumer.add_task_queue(spec.queue)
        for name in old.keys() - specs.keys():
            self.removed[name] = old[name]
            if by == "the reload":  # retired once every child is on the new file
                self.removing.add(name)
            else:
                self.retire_model(name, by)
        consumed = set(self.dispatcher.liveness.consumed_queues())
        os.environ["IQ_WORKER_MODELS"] = ",".join(
            name for name, spec in specs.items() if spec.queue in consumed)
        # Two full batches per child of the largest model it now serves: raised for a bigger
        # one added or grown, lowered for one removed (its jobs fail) or shrunk.
        self.dispatcher.fit_prefetch()
        return set(specs) - set(old)

    def _hold(self, gaining: set[str]) -> None:
        """The models the children on the previous file lack wait in the buffer until none
        of those children is left (a batch handed to one would fail `model_unavailable`).
        A model no longer held (a rollback serves a removed model again) has its buffered
        jobs handed out on the event loop's next turn: nothing else would start them, as
        no job arrives while held ones fill the worker's prefetch."""
        held = self.dispatcher.scheduler.held
        before = set(held)
        held.clear()
        if self.stale:
            held.update(gaining)
        held.update(self.removing)
        if held:
            logger.info("jobs of %s wait for a child on the new models file",
                        ", ".join(sorted(held)))
        if before - held:  # not now: a rollback may run inside the pool's maintenance
            self.consumer.timer.call_after(0.0, self.dispatcher.pump)

    def retire_model(self, name: str, by: str = "the reload") -> None:
        """A model the new file removed: what waits in the buffer fails now; its queue stays
        consumed, so that what is still queued (or queued by an API not yet reloaded) fails
        too, at once, rather than wait for a worker that will never come."""
        held = self.dispatcher.scheduler.remove_model(name)
        if held:
            self.dispatcher.settlement.fail([p.job for p in held], removed_error(name))
        logger.warning("model %s removed by %s: %d buffered job(s) failed; its queue's "
                       "jobs fail as they arrive", name, by, len(held))

    # -- the children, one at a time -----------------------------------------------------
    def _pids(self) -> set[int]:
        pool = getattr(self.consumer.pool, "_pool", None)
        return {p.pid for p in getattr(pool, "_pool", ())}

    def step(self) -> None:
        """Replace the next child on the previous file once the last replacement is up:
        a child that holds no batch goes now; else the next to hand back its batch
        (`PoolDispatcher._returned` calls this before it hands out more)."""
        pool = self.consumer.pool
        if not self._caught_up(pool):
            return
        self.stale &= self._pids()
        if not self.stale and self.removing and self.state == "reloading":
            for name in sorted(self.removing):  # no child serves them now
                self.retire_model(name)
            self.removing.clear()
        if not self.stale and self.dispatcher.scheduler.held:
            self.dispatcher.scheduler.held.clear()  # every child has the new models
            self.dispatcher.pump()
        if self.stale:
            self._replace_next(pool)
            return
        self.turn.release()
        if self._timer is not None:  # done, or rolled back
            self._timer.cancel()
            self._timer = None
        if self.state == "reloading":
            self.state, self.previous = "serving", None
            pin(self.content)  # a child that fails from now on stops the worker, as at start
            logger.info("reload done: every child on models file revision %s", self.revision)
            self.report()

    def _caught_up(self, pool) -> bool:
        """Whether the last replacement is up: a surge child ready, a retired child gone
        and its replacement ready."""
        if self.surge_before is not None:
            if not ready_children(pool) - self.surge_before:
                return False  # its child still loads; the old one serves
            self.surge_before, self.shrink_next = None, True
            logger.info("reload: the surge child serves; a child on the previous file stops "
                        "after its batch")
        if self.retiring is not None:
            gone = self.retiring not in self._pids()
            fresh = ready_children(pool) - self.before_retiring
            if not (gone and fresh):
                return False
            self.retiring = None
            self.turn.release()  # a child serves again: the next worker's turn
            self.dispatcher.pump()  # the replacement takes work
        return True

    def _replace_next(self, pool) -> None:
        """The next child on the previous file replaced: a surge's end shrinks the pool, a
        last serving child gets a surge child beside it first, any other goes after its
        batch."""
        # A child still loading the file rolled back from fails and goes by itself: no
        # turn taken for it.
        if not self.stale & ready_children(pool):
            return
        if self.shrink_next:  # a surge's end: no child comes in its place
            indices = self._indices()
            retired = retire_idle_child(pool, self.stale, shrink=True)
            if retired is not None:
                self._forget(indices.get(retired))
                self.shrink_next = False
                self.stale.discard(retired)
                self.turn.release()  # its new child serves: the next worker's turn
                logger.info("reload: child %d stops after its batch, the pool back to its "
                            "size; %d more to replace", retired, len(self.stale))
                self.step()
            return
        if self.surges and len(ready_children(pool)) == 1:
            # Its last serving child: a new one loads beside it first, in this worker's
            # turn on its queues (one worker's new child loads at a time: the roll
            # halts at the first that cannot load it).
            if not self._take_turn():
                return
            self.surge_before = self._pids()
            if surge(pool):
                logger.info("reload: a surge child loads models file revision %s%s beside "
                            "the last one serving", self.revision, self._which())
                return
            self.surge_before = None
        if not self._may_retire():
            return
        self.before_retiring = self._pids()
        self.retiring = retire_idle_child(pool, self.stale)
        if self.retiring is not None:
            self.stale.discard(self.retiring)
            logger.info("reload: child %d stops after its batch, its replacement to load "
                        "models file revision %s%s; %d more to replace", self.retiring,
                        self.revision, self._which(), len(self.stale))
            self.dispatcher.fit_intake()  # its last child: the buffer to other workers

    def _indices(self) -> dict[int, int]:
        pool = getattr(self.consumer.pool, "_pool", None)
        return {p.pid: p.index for p in getattr(pool, "_pool", ()) if hasattr(p, "index")}

    def _forget(self, index: int | None) -> None:
        """A child stopped with no other taking its index (a surge's end): its copies' live
        entries and versions go now (a SIGKILLed child cannot), rather than be counted and
        listed (GET /v1/models, /readyz) until they lapse."""
        if index is None:
            return
        member = f"{self.consumer.hostname}/{index}"
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for name in set(self.app.conf.iq_models) | set(self.removed):
                    pipe.zrem(live_key(name), member)
                    pipe.hdel(versions_key(name), member)
                pipe.execute()
        except redis.RedisError as exc:  # they lapse by themselves
            logger.warning("could not remove stopped child %s's live entries: %s", member, exc)

    def _may_retire(self) -> bool:
        """Whether a child may stop now: while another child of this worker serves, yes;
        its last serving child only in this worker's turn on the queues it consumes."""
        ready = len(ready_children(self.consumer.pool))
        if ready > 1:
            return True
        return ready == 1 and self._take_turn()

    def _take_turn(self) -> bool:
        """This worker's turn on the queues it consumes (taken now, or held), for its last
        serving child. Taken while reloading, a failed load of the revision recorded since
        the last look rolls back instead, the turn given back: the worker whose child failed
        gives its turn back only once it saw the failure, and a step (a batch returned, a
        child up: `PoolDispatcher`) comes without a look at it, so that the next worker
        could start a child on a file known not to load (issue 37's loose ends)."""
        if not self.turn.take(self.dispatcher.liveness.consumed_queues()):
            return False
        if self.state != "reloading" or self.previous is None:
            return True
        failure = failure_of(self.client, self.revision)
        if not failure:
            return True
        self.roll_back(failure)
        self.turn.release()
        return False

    def _which(self) -> str:
        """How a log line names the file a new child loads: the reload's, or the rollback's
        (an operator reads which revision each worker tried)."""
        return " (the new file)" if self.state == "reloading" else \
            " (the file rolled back to)"

    def serves(self) -> dict:
        """What this worker can serve (tasks/serves.py), for a reload's check."""
        if self.gpus is None:  # nvidia-smi, once: never CUDA in the main process
            self.gpus = visible_gpu_count(self.app.conf.iq_settings)
        return capabilities(self.app.conf.iq_settings, gpus=self.gpus,
                            queues=sorted(self.dispatcher.liveness.consumed_queues()),
                            consumes_all=bool(getattr(self.app.conf, "iq_consumes_all", False)))

    def report(self) -> None:
        waiting = self.turn.waiting_for if self.stale and not self.turn.held else ""
        status = {"revision": self.revision, "state": self.state, "at": time.time(),
                  "children_left": len(self.stale) + self.unavailable, "error": self.error,
                  "waiting_for": waiting,
                  "refused": self.refused_revision,
                  "announcement": self.announcement,  # its number, when it began or refused
                  "metrics": getattr(self.app.conf, "iq_metrics_address", None),
                  "started": self.started,  # scripts/reload_wait.py Restarts
                  **self.serves()}
        try:
            self.client.hset(RELOAD_STATUS_KEY, f"worker:{self.consumer.hostname}",
                             orjson.dumps(status))
        except redis.RedisError as exc:
            logger.warning("could not report the reload's state: %s", exc)
