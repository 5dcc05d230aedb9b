"""`make run`'s stop, in the order the processes depend on each other (scripts/run.py).

Honcho's own stop sends SIGTERM to every process group at once: Redis went at the same instant
as the worker, whose running batch then could not store its results, held the stop until
honcho's SIGKILL and ran again after the next start. `OrderedManager` extends honcho's Manager
so that a stop (Ctrl-C, SIGTERM, a hang-up, or a part that stopped for good) goes in steps,
each begun once the one before is gone:

1. `intake` and the rest: the API (gunicorn stops accepting and answers what it holds), the
   workers (each stops fetching, lets its running batches finish and store their results,
   puts what waits in its buffer back on the queues: workers/batching/stopping.py), and beside them
   the webhook deliverer, Flower and anything else but Redis: none of these waits for a worker
   (pending deliveries wait in Redis), and each has the whole stop's time (with its Redis frozen
   the deliverer needs ~25 s: told after the worker, it was killed);
2. `sentinels`, then 3. `redis`: Redis (and its replicas) last, once nothing writes to it.

Before the first step, each Redis node and sentinel is sent SIGCONT: a Redis frozen (SIGSTOP,
an operator's mistake) lets no batch store its results (they ran again after the next start)
and acts on no SIGTERM (it was killed, its file unwritten); woken, the stop drains as with a
Redis that runs, to which SIGCONT is nothing.

An API left holding only clients' `?wait`s once the workers are gone (gunicorn would let them
run out, up to 35 s) gets gunicorn's quick stop, SIGQUIT, `QUICK_AFTER_S` later: nothing would
change a job any more, and the clients resend. The whole stop is bounded by IQ_STOP_TIMEOUT_S
(`stop_timeout_s`): a step still running `STEP_GRACE_S` past it (a worker's own stop puts
back what a batch that never returns holds at IQ_STOP_TIMEOUT_S, and needs Redis for it) no
longer holds the next one back, and what is left `KILL_MARGIN_S` past it is killed (SIGKILL),
saying so. A hang-up (SIGHUP: the terminal closed) stops the stack as Ctrl-C does: the parts
run in sessions of their own, so nothing else would tell them.
"""
from __future__ import annotations

import datetime
import os
import queue
import signal
import threading
import time

from honcho import manager as honcho_manager
from honcho.manager import Manager
from honcho.printer import Message
from honcho.process import Process

# After the stop timeout: how long the last steps (Redis's shutdown writes its file) have
# before what is left is killed.
KILL_MARGIN_S = 5.0
# Past the stop timeout, when a step that has not ended no longer holds the next one back: a
# worker's own stop puts back what its batches still hold at the stop timeout (Redis must be
# there), and Redis then has KILL_MARGIN_S - STEP_GRACE_S for its shutdown.
STEP_GRACE_S = 2.0
QUICK_STOP = {"web": signal.SIGQUIT}  # gunicorn's quick shutdown: workers exit at once
# Once the rest of its step is gone, how long a QUICK_STOP process has before its quick stop.
QUICK_AFTER_S = 1.0

honcho_manager.SIGNALS.setdefault(signal.SIGHUP, {"name": "SIGHUP", "rc": 129})


def is_redis(name: str) -> bool:
    """A Redis node or sentinel of make run's Procfile, by its name."""
    return name == "redis" or name.startswith(("redis-", "sentinel-"))


def is_worker(name: str) -> bool:
    return name == "worker" or name.startswith("worker-")


def step_of(name: str) -> int:
    """The step (0-2) of a process of make run's Procfile, by its name."""
    if name.startswith("sentinel-"):
        return 1
    if is_redis(name):
        return 2
    return 0


class KeptProcess(Process):
    """Honcho's reader of one process, deaf to a hang-up as it is to SIGINT and SIGTERM: a
    terminal that closes signals make run's whole group, these readers included, and a reader
    gone would leave its process writing into a pipe no one reads, its stop never seen."""

    def run(self, events=None, ignore_signals=False):
        if ignore_signals:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        super().run(events, ignore_signals)


class OrderedManager(Manager):
    def __init__(self, printer, stop_timeout_s: float) -> None:
        super().__init__(printer)
        self._process_ctor = KeptProcess
        self.stop_timeout_s = stop_timeout_s
        self._stopper: threading.Thread | None = None

    def loop(self) -> None:
        def hang_up(_signum, _frame) -> None:
            self._say("SIGHUP received (hang-up): stopping as Ctrl-C does")
            self.returncode = 129
            self.terminate()

        # Honcho's loop sets its own SIGINT and SIGTERM handlers; a hang-up is this one's.
        signal.signal(signal.SIGHUP, hang_up)
        super().loop()
        # Honcho's loop ends once every process has: print what the stop said after it.
        if self._stopper is not None:
            self._stopper.join(1.0)
        while True:
            try:
                message = self.events.get(timeout=0.1)
            except queue.Empty:
                break
            if message.type == "line":
                self._printer.write(message)

    def terminate(self) -> None:
        """Begin the stop, in steps (honcho's loop calls this on a signal, and when a part
        stops for good); honcho's loop goes on reading their output and exits once all are
        gone."""
        if self._terminating:
            return
        self._terminating = True
        self._stopper = threading.Thread(target=self._stop_in_steps, name="make-run-stop",
                                         daemon=True)
        self._stopper.start()

    def kill(self) -> None:
        """Honcho's loop kills what is left KILL_WAIT after the first process stopped; here
        the stop's own deadline does (`_stop_in_steps`)."""

    def _running(self, names: list[str]) -> list[str]:
        return [n for n in names if 'returncode' not in self._processes[n]
                and self._processes[n].get('pid') is not None]

    def _signal(self, names: list[str], sig: int) -> None:
        for name in names:
            pid = self._processes[name].get('pid')
            if pid is None:
                continue
            self._say(f"sending {signal.Signals(sig).name} to {name} (pid {pid})")
            try:
                os.killpg(pid, sig)  # its group: the keeper, the process, its children
            except OSError:  # gone meanwhile
                pass

    def _stop_in_steps(self) -> None:
        started = time.monotonic()
        # A process still starting (no pid yet) is waited for: it is stopped in its step.
        while not self._all_started() and time.monotonic() - started < self.stop_timeout_s:
            time.sleep(0.05)
        steps: dict[int, list[str]] = {}
        for name in self._processes:
            steps.setdefault(step_of(name), []).append(name)
        self._say("stopping in order: " + "; then ".join(", ".join(steps[i])
                                                           for i in sorted(steps)))
        # A Redis frozen (SIGSTOP) would hold the whole stop: the running batches could not
        # store their results (they would run again after the next start), and it would act on
        # no SIGTERM. Woken now, everything drains as it does with Redis running.
        self._signal(self._running([n for n in self._processes if is_redis(n)]),
                     signal.SIGCONT)
        # A worker's own stop puts back, stop_timeout_s in, what its batches still hold: Redis
        # must still be there then.
        step_deadline = started + self.stop_timeout_s + STEP_GRACE_S
        kill_at = started + self.stop_timeout_s + KILL_MARGIN_S
        for index in sorted(steps):
            names = self._running(steps[index])
            self._signal(names, signal.SIGTERM)
            deadline = kill_at if index == max(steps) else step_deadline
            # What a `?wait` waits on: once the workers have gone, nothing changes a job.
            workers = [n for n in names if is_worker(n)]
            quick_at = None
            while self._running(names) and time.monotonic() < deadline:
                if quick_at is None and not self._running(workers):
                    quick_at = time.monotonic() + QUICK_AFTER_S
                elif quick_at is not None and time.monotonic() >= quick_at:
                    # Only `?wait`s are left (submits are answered in milliseconds), and
                    # nothing will change a job now: they end, and their clients resend.
                    for name in self._running(names):
                        if name in QUICK_STOP:
                            self._signal([name], QUICK_STOP[name])
                    quick_at = float("inf")
                time.sleep(0.05)
            late = self._running(names)
            if late and index != max(steps):
                self._say(f"{', '.join(late)} still running {time.monotonic() - started:.1f}s "
                          f"into the stop (IQ_STOP_TIMEOUT_S {self.stop_timeout_s:g}); "
                          f"going on with the next step")
        while self._running(list(self._processes)) and time.monotonic() < kill_at:
            time.sleep(0.05)
        left = self._running(list(self._processes))
        if left:
            self._say(f"SIGKILL to {', '.join(left)}: still running "
                      f"{time.monotonic() - started:.1f}s into the stop")
            self._signal(left, signal.SIGKILL)
        else:
            self._say(f"stopped in {time.monotonic() - started:.1f}s, in order, nothing killed")

    def _say(self, text: str) -> None:
        """A line of make run's own, from any thread (honcho's loop prints it)."""
        self.events.put(Message("line", text + "\n", datetime.datetime.now(), "system", None))
