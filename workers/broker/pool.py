"""Two adjustments of the worker's prefork pool, made on the pool object when the dispatcher
first meets it (workers/strategy.py); two of billiard's and Celery's classes, installed with
the Broker (`patches`): the pool stops a child with SIGKILL, and tells the dispatcher when a
child is ready to take work (`on_child_ready`); and the looks inside it the dispatcher and a
reload need (workers/dispatcher.py, workers/reload.py): which children take work, and
stopping an idle one so that the pool starts another in its place."""
from __future__ import annotations

import errno
import logging
import os
import signal
from typing import Any

from billiard.pool import Pool
from billiard.process import BaseProcess
from celery.concurrency.asynpool import AsynPool

from workers.broker.patch import Patch

logger = logging.getLogger(__name__)


def guard_pool_growth(pool: Any, gpus: int) -> None:
    """One pool child per GPU: growing the pool past the host's GPU count (`celery control
    pool_grow`, autoscale) is refused with a log message. No limit on a CPU-only host."""
    if gpus <= 0 or getattr(pool, "_iq_guarded", False):
        return
    grow = pool.grow

    def guarded_grow(n: int = 1) -> Any:
        if pool.num_processes + n > gpus:
            logger.error("refusing to grow the pool from %d to %d children: this host has %d "
                         "GPU(s) and each child owns one; add a worker host instead",
                         pool.num_processes, pool.num_processes + n, gpus)
            return None
        return grow(n)

    pool.grow = guarded_grow
    pool._iq_guarded = True


def keep_batches_through_reconnects(pool: Any) -> None:
    """When the broker connection goes, Celery flushes the pool (`Consumer.on_close`): it
    discards every job no child has accepted yet and clears what waits to be written to a
    child, because the broker will redeliver those messages. Here every pool job is a batch
    whose messages the dispatcher holds by their leases, which kombu does not restore
    (workers/broker/unacked.py), so nothing would redeliver them: a batch discarded in the
    milliseconds between its hand-over and its child's acceptance never came back, and the
    dispatcher counted that child busy for good, so the worker took no more work. The flush
    is skipped: batches in flight are written, run and settled as after any reconnect."""
    if not getattr(pool, "_iq_keeps_batches", False):
        pool.flush = _keep_every_batch
        pool._iq_keeps_batches = True


def _keep_every_batch() -> None:
    """The pool's flush on a reconnect: nothing to drop (keep_batches_through_reconnects)."""


def patches() -> list[Patch]:
    """The pool stops a child with SIGKILL where billiard and Celery send it SIGTERM. A child
    ignores SIGTERM once its models are loaded (workers/stopping.py: a stop of the worker's
    whole process group must not kill its batch), so their SIGTERM would no longer stop it:
    not at a cold shutdown (Celery cancels the running tasks with `terminate_job`, then
    `Pool.terminate` waits for its children), a shrink or a reload's retirement of an idle
    child (`terminate_controlled`), a `revoke --terminate`, nor at a hard time limit (billiard
    follows with SIGKILL 0.1 s later there anyway). SIGTERM at its default killed the child at
    once, running no handler of its own: SIGKILL does the same. Another signal asked for
    (`revoke --signal`) is sent as asked. Installed in a worker's main process only, where
    every billiard process is a pool child; on the class, not on each process object, since a
    spawned child's process object is pickled for it."""
    return [Patch(BaseProcess, "terminate", lambda _original: kill_child),
            Patch(Pool, "terminate_job", _sigkill_for_sigterm),
            Patch(AsynPool, "on_process_alive", _tell_when_alive)]


def kill_child(process: Any) -> None:
    """billiard's `Process.terminate` (popen_fork's), with SIGKILL for its SIGTERM."""
    process._check_closed()
    popen = process._popen
    if popen is None or popen.returncode is not None:
        return
    try:
        os.kill(popen.pid, signal.SIGKILL)
    except OSError as exc:
        if exc.errno != errno.ESRCH:
            raise


def _sigkill_for_sigterm(original: Any) -> Any:
    def terminate_job(self: Any, pid: int, sig: int | None = None) -> Any:
        return original(self, pid, signal.SIGKILL if sig in (None, signal.SIGTERM) else sig)

    return terminate_job


def _tell_when_alive(original: Any) -> Any:
    """The pool's handler of a child's first word (WORKER_UP: its initializer, which loads its
    models, returned), followed by the callback `on_child_ready` gave it, if any."""
    def on_process_alive(self: Any, pid: int) -> Any:
        out = original(self, pid)
        callback = getattr(self, "_iq_on_child_ready", None)
        if callback is not None:
            callback(pid)
        return out

    return on_process_alive


def on_child_ready(pool: Any, callback: Any) -> bool:
    """`callback(pid)` from now on each time a child of the pool is ready to take work (its
    models loaded), on the event loop. False when the pool has not started."""
    inner = _asynpool(pool)
    if inner is None:
        return False
    inner._iq_on_child_ready = callback
    return True


def _asynpool(pool: Any) -> Any:
    """Celery's AsynPool inside its prefork TaskPool (None before the pool started)."""
    return getattr(pool, "_pool", None)


def ready_children(pool: Any) -> set[int]:
    """The pids of the children that take work: started, their models loaded (the pool
    hears from a child only once its initializer, which loads them, returned)."""
    inner = _asynpool(pool)
    if inner is None:
        return set()
    return {p.pid for p in inner._pool if p._is_alive() and p.inqW_fd in inner._all_inqueues}


def serving_children(pool: Any) -> int | None:
    """How many children take work now (`ready_children`); None for a pool that is not
    Celery's prefork pool, or not started (then every one of its processes counts)."""
    if _asynpool(pool) is None:
        return None
    return len(ready_children(pool))


def retire_idle_child(pool: Any, among: set[int]) -> int | None:
    """Stop one child of `among` that holds no batch, nor is being written one: it is taken
    out of the children the pool writes to, then terminated as the pool shrinks a child
    (`terminate_controlled`, a SIGKILL here: no error logged), and the pool starts another in
    its place. Returns its pid; None when every one of them is busy."""
    inner = _asynpool(pool)
    if inner is None:
        return None
    busy = inner._busy_workers | inner._active_writes
    for proc in list(inner._pool):
        fd = proc.inqW_fd
        if proc.pid in among and proc._is_alive() and fd in inner._all_inqueues \
                and fd not in busy:
            inner._all_inqueues.discard(fd)
            proc.terminate_controlled()
            return proc.pid
    return None
