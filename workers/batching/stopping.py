"""A worker's stop within a bound. Told to stop (SIGTERM), Celery lets the running batches
finish before it exits, however long they take: a call that never returns would hold the stop
until the model's time limit, and a supervisor's patience is shorter. So `stop_timeout_s`
after the stop began, the jobs of the batches still running go back on their queues and their
pool children are killed; should the worker still not be gone some seconds later, it exits.

The stop is the main process's alone. `make run` (honcho), systemd's default
KillMode=control-group and container runtimes send their SIGTERM to every process of the
worker, its pool children too, and Celery leaves a child's SIGTERM at its default: the child
died in the middle of its batch, which then ran a second time elsewhere. So a child whose
models are loaded ignores SIGTERM (`hold_stops_for_the_main_process`; Celery already ignores
SIGINT in its children), and the pool stops a child with SIGKILL instead (a cold shutdown, a
shrink, a reload's retirement: workers/broker/pool.py); a child whose main process is gone is
killed by the kernel (Celery sets its parent-death signal to SIGKILL)."""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Protocol, runtime_checkable

from workers.broker import Leases

logger = logging.getLogger(__name__)

# After the children were stopped, how long the worker may still take to exit.
EXIT_GRACE_S = 15.0
# Past stop_timeout_s, when a worker whose stop never reached its StopDeadline (its consumer
# stuck on a frozen Redis) exits all the same (`exit_within`): before make run's kill, 5 s.
LAST_RESORT_S = 3.0


@runtime_checkable
class PoolChildren(Protocol):
    def pool_pids(self) -> list[int]: ...


@runtime_checkable
class Stoppable(Protocol):
    """What the stop deadline needs of its worker's dispatcher (workers/batching/dispatcher.py),
    which hands itself in: the delivery tags of the batches in its pool, the leases that put
    them back on their queues, and the pool children to kill."""

    def running_tags(self) -> list[str]: ...

    @property
    def leases(self) -> Leases: ...

    @property
    def liveness(self) -> PoolChildren: ...


class StopDeadline:
    def __init__(self, dispatcher: Stoppable, seconds: float) -> None:
        self.dispatcher = dispatcher
        self.seconds = seconds
        self._armed = False

    def arm(self) -> None:
        """The stop began: from now on, the clock runs (once)."""
        if not self._armed:
            self._armed = True
            threading.Thread(target=self._run, name="iq-stop-deadline", daemon=True).start()

    def _run(self) -> None:
        threading.Event().wait(self.seconds)
        dispatcher = self.dispatcher
        tags = dispatcher.running_tags()
        if tags:
            logger.warning("still running %d job(s) %gs into the stop: back on their queues, "
                           "and their pool children stopped", len(tags), self.seconds)
            try:
                dispatcher.leases.inflight.restore(tags)
            except Exception:  # noqa: BLE001 - the children must stop all the same
                logger.warning("could not put them back; they come back when this worker's "
                               "lease runs out", exc_info=True)
            for pid in dispatcher.liveness.pool_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        threading.Event().wait(EXIT_GRACE_S)
        logger.critical("the worker has not exited %gs into its stop; exiting now",
                        self.seconds + EXIT_GRACE_S)
        logging.shutdown()
        os._exit(1)


def hold_stops_for_the_main_process() -> None:
    """In a pool child, once its models are loaded: a SIGTERM is ignored. The main process got
    the same one (a stop signals the whole group) and ends this child's batch its own way: it
    lets it finish, then tells the child to exit; or, stop_timeout_s in, puts it back and
    kills the child (StopDeadline). A child still loading its models holds no batch: it dies of
    a SIGTERM, as before, rather than hold the stop until its models are loaded."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


_exit_armed = threading.Lock()


def exit_within(seconds: float, what: str) -> None:
    """The process was told to stop (a warm or cold shutdown): should it still be here
    `seconds` later, it exits. A Celery worker's stop talks to Redis (its consumer closes, its
    lease and in-flight record are settled) and, with Redis frozen or unreachable, each call
    waits out its socket timeout and retries: the webhook deliverer stayed over 60 s after a
    SIGTERM. What it still held is its in-flight record's, and comes back when its lease runs
    out (workers/broker/inflight.py). Armed once; later calls do nothing."""
    if not _exit_armed.acquire(blocking=False):
        return

    def run() -> None:
        threading.Event().wait(seconds)
        logger.critical("%s has not exited %gs into its stop; exiting now", what, seconds)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=run, name="iq-exit-within", daemon=True).start()
