"""A batch handed to the worker's pool (workers/broker/pool.py `Pool`) is written to an idle
child's pipe at once, by Celery's own write handlers, not when the event loop next turns: that
turn first fires the timers due, re-issues kombu's BRPOP and polls, all while the child waits
for its batch (a lone job's path, issue 40). Celery's choice of child is kept: none is written
while every child holds a batch.

The pool here is Celery's AsynPool code on a real pipe and a real kombu hub, whose loop is
never turned; only the pool's processes are left out."""
from __future__ import annotations

import os
import struct
from collections import Counter, deque
from types import SimpleNamespace

import pytest
from billiard.pool import TASK
from celery.concurrency.asynpool import SCHED_STRATEGY_FAIR
from kombu.asynchronous import Hub

from workers.broker.pool import HeldBatches, Pool


@pytest.fixture
def pool():
    """A `Pool` with one child's inqueue (a pipe, written through the child's
    `send_job_offset` as billiard's is) and Celery's write handlers on a kombu hub."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    child = SimpleNamespace(index=0, send_job_offset=lambda buf, offset:
                            os.write(write_fd, buf[offset:]))
    p = Pool.__new__(Pool)  # no processes: the write handlers alone
    p._fileno_to_inq, p._fileno_to_synq = {write_fd: child}, {}
    p.outbound_buffer = deque()
    p._all_inqueues = {write_fd}
    p._active_writes, p._active_writers = set(), set()
    p._busy_workers = HeldBatches(p._all_inqueues)
    p._cache, p.write_stats = {}, Counter()
    p.sched_strategy = SCHED_STRATEGY_FAIR
    hub = Hub()
    p._create_write_handlers(hub)
    p.read_fd, p.write_fd = read_fd, write_fd
    yield p
    hub.close()
    os.close(read_fd)
    os.close(write_fd)


def _hand(pool, job_id: int) -> None:
    """What billiard's apply_async does with a batch: its job in the cache, then put."""
    pool._cache[job_id] = SimpleNamespace(_accepted=False, _terminated=None,
                                          correlation_id=str(job_id))
    pool._quick_put((TASK, (job_id, None, len, ("batch",), {})))


def _on_pipe(pool) -> bytes:
    try:
        return os.read(pool.read_fd, 65536)
    except BlockingIOError:
        return b""


def test_a_batch_is_on_an_idle_childs_pipe_before_the_loop_turns(pool):
    _hand(pool, 1)
    written = _on_pipe(pool)
    assert written, "the batch waits in the pool's outbound buffer for the loop's next turn"
    (size,) = struct.unpack(">I", written[:4])
    assert len(written) == 4 + size and not pool.outbound_buffer
    assert pool._busy_workers.held == {pool.write_fd: 1}  # the child holds it, as Celery counts


def test_no_child_is_written_while_every_child_holds_a_batch(pool):
    _hand(pool, 1)
    _on_pipe(pool)
    _hand(pool, 2)  # one child, holding one batch (depth 1: no batch ahead)
    assert _on_pipe(pool) == b"" and len(pool.outbound_buffer) == 1


def test_a_reconnect_does_not_track_a_child_whose_exit_was_handled():
    """A reconnect registers the pool with the event loop again, each child's sentinel
    tracked. A child whose exit the loop handled already (its sentinel closed, None) stays in
    the pool until its exit status is read, up to the pool's next maintenance: it was handed
    to the hub as a file descriptor, and the worker stopped on "ValueError: file descriptor
    is None" (seen after a reload replaced the children, tests/integration/test_prefetch.py).
    A live child is tracked as before."""
    hub, p = Hub(), Pool.__new__(Pool)
    p._track_child_process(SimpleNamespace(_sentinel_poll=None), hub)
    assert not hub.readers
    read_fd, write_fd = os.pipe()
    try:
        p._track_child_process(SimpleNamespace(_sentinel_poll=read_fd), hub)
        assert read_fd in hub.readers
    finally:
        hub.close()
        os.close(read_fd)
        os.close(write_fd)
