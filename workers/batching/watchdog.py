"""The worker's watchdog: a worker that has stopped working restarts itself, rather than sit
with its jobs while /readyz says all is well.

Two ways a worker stops working without dying:

* Its event loop stops turning: a call that never returns (a read on a silent socket with no
  timeout) holds the main thread. Seen by a thread of its own: the loop's periodic tick has
  not come for `limit_s` while Redis answers this thread's PING (a Redis outage stalls the
  loop legitimately; Celery reconnects when Redis is back).
* Its loop turns but it no longer fetches: for `limit_s` it had an idle pool child and an
  empty buffer while jobs waited on the queues it consumes. Seen by the tick itself.

Either way it logs why with every thread's stack, puts what it holds back on the queues,
kills its pool children and starts itself again (same command line, same process id).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
from time import monotonic
from typing import Callable, Protocol, runtime_checkable

import redis

from config import Settings
from tasks.redis_client import connect
from workers.broker import Leases

logger = logging.getLogger(__name__)

# The command line this worker was started with, before anything could change sys.argv.
ARGV = list(sys.argv)


@runtime_checkable
class Watched(Protocol):
    """What the watchdog needs of its worker's liveness (workers/batching/liveness.py), which
    hands itself in: its settings, the leases on what the worker holds, its pool children."""

    @property
    def settings(self) -> Settings: ...

    @property
    def leases(self) -> Leases: ...

    def pool_pids(self) -> list[int]: ...


class Watchdog:
    def __init__(self, limit_s: float, liveness: Watched,
                 clock: Callable[[], float] = monotonic) -> None:
        """`liveness`: the worker's (workers/batching/liveness.py): its settings, leases and
        pool."""
        self.limit_s = limit_s
        self.liveness = liveness
        self.clock = clock
        self.last_beat = clock()
        self.idle_since: float | None = None
        self.active = False
        self._thread: threading.Thread | None = None

    # -- what the event loop reports -----------------------------------------------------
    def beat(self) -> None:
        self.last_beat = self.clock()

    def observe_idle_with_work(self, stalled: bool) -> None:
        if not stalled or not self.enabled:
            self.idle_since = None
            return
        if self.idle_since is None:
            self.idle_since = self.clock()
        elif self.clock() - self.idle_since > self.limit_s:
            self.restart(f"idle for {self.clock() - self.idle_since:.0f}s with jobs waiting "
                         "on its queues: it stopped fetching them")

    # -- decisions -----------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.active and self.limit_s > 0

    def loop_stalled(self) -> bool:
        return self.enabled and self.clock() - self.last_beat > self.limit_s

    # -- the thread ----------------------------------------------------------------------
    def start(self) -> None:
        """Watch from now on (again after a reconnect); the thread starts once."""
        self.last_beat = self.clock()
        self.idle_since = None
        self.active = True
        if self.limit_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="iq-watchdog",
                                            daemon=True)
            self._thread.start()

    def pause(self) -> None:
        """Not while the worker is reconnecting or shutting down: its loop is busy with that."""
        self.active = False

    def _watch(self) -> None:
        settings = self.liveness.settings
        ping = connect(settings.redis_url, settings, deadline_s=5.0)  # the primary, by Sentinel too
        interval = max(min(self.limit_s / 4, 5.0), 0.5)
        while True:
            threading.Event().wait(interval)
            if not self.loop_stalled():
                continue
            try:
                ping.ping()
            except redis.RedisError:
                continue  # Redis is away: the loop waits for it, as it should
            self.restart(f"its event loop has not turned for "
                         f"{self.clock() - self.last_beat:.0f}s while Redis answers")

    # -- the restart ---------------------------------------------------------------------
    def restart(self, reason: str) -> None:
        logger.critical("watchdog: this worker stopped working: %s; restarting it", reason)
        try:
            # Where the event loop is stuck. sys.stderr may be Celery's logging proxy, which
            # has no file descriptor: the real one.
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        except (OSError, ValueError, AttributeError):
            pass
        liveness = self.liveness
        try:
            # Everything it holds, buffered or running, back on the queues: the children
            # running some of it are killed next.
            liveness.leases.inflight.restore(liveness.leases.snapshot())
        except Exception:  # noqa: BLE001 - nothing may stop the restart
            logger.warning("watchdog: could not requeue held jobs; they come back when their "
                           "leases run out")
        for pid in liveness.pool_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        logging.shutdown()
        os.execv(sys.executable, [sys.executable, *ARGV])
