"""Two adjustments of the worker's prefork pool, made on the pool object when the dispatcher
first meets it (workers/strategy.py); and the two looks inside it a reload needs
(workers/reload.py): which children take work, and stopping an idle one so that the pool
starts another in its place."""
from __future__ import annotations

import logging
from typing import Any

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


def retire_idle_child(pool: Any, among: set[int]) -> int | None:
    """Stop one child of `among` that holds no batch, nor is being written one: it is taken
    out of the children the pool writes to, then terminated as the pool shrinks a child
    (`terminate_controlled`: no error logged), and the pool starts another in its place.
    Returns its pid; None when every one of them is busy."""
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
