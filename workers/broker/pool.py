"""Two adjustments of the worker's prefork pool, made on the pool object when the dispatcher
first meets it (workers/strategy.py)."""
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
