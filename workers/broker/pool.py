"""The worker's prefork pool: Celery's, subclassed (`TaskPool`), which a worker of this service
runs (`worker_pool`, and in place of `-P prefork`: workers/broker/attach.py's `attach`). It

* stops a child with SIGKILL where billiard and Celery send it SIGTERM (`kill_child`);
* tells the dispatcher when a child is ready to take work (`on_child_ready`);
* writes a child its next batch while it runs one (`HeldBatches`, `hold_ahead`), an idle
  child always first, and says which children hold none (`free_children`);
* writes a batch to a child as it is handed to the pool, not at the event loop's next turn
  (`_write_at_once`);
* is grown no further than the GPUs (`TaskPool.cap_children`);
* is not flushed on a reconnect (`TaskPool.keep_every_batch`);
* starts billiard's semaphore tracker again should it be gone, looking at it every few
  seconds on the event loop (workers/broker/tracker.py, `TaskPool.register_with_event_loop`);

* tells a reload before it starts children in place of those that exited
  (`before_children_start`), so that a failed reload's pin is undone first;

and the looks inside it the dispatcher and a reload need (workers/batching/dispatcher.py,
workers/batching/reload.py): which children take work, stopping an idle one so that the pool starts
another in its place, and a surge: one child more, started beside the others, then one
stopped with the pool shrunk back (`surge`, `retire_idle_child(shrink=True)`,
`end_surge`)."""
from __future__ import annotations

import errno
import logging
import os
import signal
from typing import Any, Callable

from billiard.context import ForkProcess, ForkServerProcess, SpawnProcess
from celery.concurrency import prefork
from celery.concurrency.asynpool import SCHED_STRATEGY_FAIR, AsynPool

from workers.broker import tracker

logger = logging.getLogger(__name__)

#: The setting that selects it.
WORKER_POOL = f"{__name__}:TaskPool"


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


class _KilledOnTerminate:
    """A pool child stopped with SIGKILL where billiard and Celery send it SIGTERM. A child
    ignores SIGTERM once its models are loaded (workers/batching/stopping.py: a stop of the
    worker's whole process group must not kill its batch), so their SIGTERM would no longer stop
    it: not at a cold shutdown (Celery cancels the running tasks with `terminate_job`, then the
    pool waits for its children), a shrink or a reload's retirement of an idle child
    (`terminate_controlled`), a `revoke --terminate`, nor at a hard time limit (billiard follows
    with SIGKILL 0.1 s later there anyway). SIGTERM at its default killed the child at once,
    running no handler of its own: SIGKILL does the same. On the class (a spawned child's process
    object is pickled for it, by the name of its class)."""

    def terminate(self) -> None:
        kill_child(self)


class SpawnChild(_KilledOnTerminate, SpawnProcess):
    pass


class ForkChild(_KilledOnTerminate, ForkProcess):
    pass


class ForkServerChild(_KilledOnTerminate, ForkServerProcess):
    pass


_CHILDREN: dict[type, type] = {SpawnProcess: SpawnChild, ForkProcess: ForkChild,
                               ForkServerProcess: ForkServerChild}


class _KillsItsChildren:
    """A billiard pool whose children are killed by SIGKILL (`_KilledOnTerminate`,
    `terminate_job`)."""

    def Process(self, *args: Any, **kwargs: Any) -> Any:
        base = self._ctx.Process
        try:
            return _CHILDREN[base](*args, **kwargs)
        except KeyError:
            raise RuntimeError(f"the worker's pool has no child class for billiard's "
                               f"{base.__qualname__} (start method "
                               f"{self._ctx.get_start_method()!r})") from None

    def terminate_job(self, pid: int, sig: int | None = None) -> Any:
        """A job's child stopped (a cancel, `revoke --terminate`): SIGKILL for SIGTERM;
        another signal asked for (`revoke --signal`) is sent as asked."""
        return super().terminate_job(pid, signal.SIGKILL if sig in (None, signal.SIGTERM)
                                     else sig)


class BlockingPool(_KillsItsChildren, prefork.BlockingPool):
    """billiard's pool, as Celery runs it without an event loop."""


class HeldBatches:
    """The pool's busy children (`AsynPool._busy_workers`: the write fds of their inqueues),
    counting the batches each holds: written to it, not returned. Celery's fair scheduling
    writes a job only to a child not in this set; a set of fds would hold one job a child, so
    a child finished its batch and waited for its parent to hear of it, hand it the next and
    write it. Here a child counts busy while it holds `depth` batches, or holds one while
    another child holds none (an idle child is always written first): with `depth` 2 its next
    batch waits in its pipe, and it starts it as the last leaves the device.

    A batch written to a child that dies before taking it up (it was not accepted) goes back
    to the pool's outbound buffer and is written to another child (Celery's
    `on_job_process_down`, `on_partial_read`): it runs once, never lost."""

    def __init__(self, inqueues: set) -> None:
        self.inqueues = inqueues  # the pool's `_all_inqueues`: the children written to
        self.held: dict[int, int] = {}
        self.depth = 1

    def _busy(self) -> set[int]:
        held = {fd: n for fd, n in self.held.items() if fd in self.inqueues}
        if len(held) < len(self.inqueues):  # a child holds none: every other is busy
            return set(held)
        return {fd for fd, n in held.items() if n >= self.depth}

    def __contains__(self, fd: object) -> bool:
        return fd in self._busy()

    def __len__(self) -> int:
        return len(self._busy())

    def __iter__(self) -> Any:
        return iter(self._busy())

    def holding(self) -> set[int]:
        """The fds of the children that hold a batch."""
        return set(self.held)

    def add(self, fd: int) -> None:
        """A batch written to the child (Celery: `mark_worker_as_busy`)."""
        self.held[fd] = self.held.get(fd, 0) + 1

    def release(self, fd: int) -> None:
        """A batch of the child returned (`AsynPool.on_job_ready`)."""
        n = self.held.get(fd, 0) - 1
        if n > 0:
            self.held[fd] = n
        else:
            self.held.pop(fd, None)

    def discard(self, fd: int) -> None:
        """The child is gone (its inqueue closed, its process down): it holds nothing."""
        self.held.pop(fd, None)

    def intersection_update(self, fds: Any) -> None:
        """Celery's flush on a reconnect (not run here: `TaskPool.keep_every_batch`)."""
        keep = set(fds)
        for fd in [fd for fd in self.held if fd not in keep]:
            del self.held[fd]


def _write_at_once(pool: Any, put: Callable[[Any], Any],
                   schedule_writes: Callable[[list], Any]) -> Callable[[Any], Any]:
    """`put` (Celery's `send_job`: the batch pickled onto the pool's outbound buffer), then
    the buffer written to the children it may go to now, as the event loop would write it
    once it turns: its next turn first fires the timers due (a task events' flush, a lease's
    beat: Redis round trips), re-issues kombu's BRPOP and polls, all before the child has
    its batch. The same choice of child as the loop's (`schedule_writes`, Celery's handler of
    writable inqueues: an idle child first, `HeldBatches`; no child written to twice at
    once), and a write the pipe cannot take whole goes on on the loop, as Celery's does."""
    fair = pool.sched_strategy == SCHED_STRATEGY_FAIR

    def put_and_write(job: Any) -> None:
        put(job)
        inqueues, busy = pool._all_inqueues, pool._busy_workers
        if not pool.outbound_buffer or (fair and len(busy) >= len(inqueues)):
            return
        ready = [fd for fd in inqueues if fd not in pool._active_writes]
        if ready:
            schedule_writes(ready)
    return put_and_write


class Pool(_KillsItsChildren, AsynPool):
    """Celery's asynchronous pool, whose children are killed by SIGKILL, which counts the
    batches each child holds (`HeldBatches`) and calls `on_child_ready(pid)` once a child is
    ready."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Before the event loop's handlers are made: they hold the set and its `add`.
        self._busy_workers = HeldBatches(self._all_inqueues)
        self._mark_worker_as_available = self._busy_workers.release

    #: Called on the event loop with a child's pid once it is ready to take work (its
    #: models loaded): the dispatcher's (`on_child_ready`).
    on_child_ready: Callable[[int], Any] | None = None
    #: Called before the pool starts children in place of those that exited (or to reach
    #: a grown size): the reload's (`Reloader.before_children_start`), which may shrink the
    #: pool back (`end_surge`) and change the file the children are started on.
    before_children_start: Callable[[], Any] | None = None

    def _create_write_handlers(self, hub: Any, *args: Any, **kwargs: Any) -> Any:
        """Celery's write handlers, with a batch handed to the pool written to a child at
        once (`_write_at_once`) rather than when the event loop next turns."""
        out = super()._create_write_handlers(hub, *args, **kwargs)
        self._quick_put = _write_at_once(self, self._quick_put, hub.consolidate_callback)
        return out

    def _track_child_process(self, proc: Any, hub: Any) -> None:
        """Celery's, but not for a child whose exit the event loop handled already: its
        handler closed the child's sentinel (`_sentinel_poll` None) and had the pool reap
        it, which leaves it in the pool while its exit status is not yet readable (a child
        a reload or a shrink replaced, one killed), until the pool's next maintenance (5 s
        at most). A reconnect in that window registered the pool again, and Celery handed
        the hub that None as a file descriptor: "Unrecoverable error: ValueError('file
        descriptor is None')", and the worker stopped."""
        if getattr(proc, "_sentinel_poll", False) is None:
            return
        super()._track_child_process(proc, hub)

    def _repopulate_pool(self, exitcodes: Any) -> Any:
        if self.before_children_start is not None:
            self.before_children_start()
        return super()._repopulate_pool(exitcodes)

    def on_process_alive(self, pid: int) -> Any:
        """The pool's handler of a child's first word (WORKER_UP: its initializer, which
        loads its models, returned), followed by `on_child_ready`."""
        out = super().on_process_alive(pid)
        if self.on_child_ready is not None:
            self.on_child_ready(pid)
        return out


class TaskPool(prefork.TaskPool):
    """Celery's prefork pool with `Pool` inside, grown no further than `cap_children` allows
    and never flushed."""

    Pool = Pool
    BlockingPool = BlockingPool
    #: Most children (one per GPU); None: no limit (a CPU-only host).
    max_children: int | None = None

    #: billiard's semaphore tracker, started again when it is gone (workers/broker/tracker.py).
    sem_tracker: tracker.RestartingTracker | None = None
    _tracker_check: Any = None

    def on_start(self) -> None:
        self.sem_tracker = tracker.install()  # before the first child starts billiard's tracker
        super().on_start()
        # Celery's on_start hands out the inner pool's methods as this object's: `grow` (as
        # `control pool_grow` and autoscale call it) and `flush` (as a reconnect calls it).
        self._grow = self.grow
        self.grow = self.grow_within_cap
        self.flush = self.keep_every_batch

    def register_with_event_loop(self, loop: Any) -> Any:
        """Celery's, and the tracker looked at every `CHECK_EVERY_S` on the event loop, so
        that one that died is replaced then, not only at the next registration. The loop
        registers the pool again at each reconnect, having cancelled the timers it set up
        (celery/worker/loops.py): the last entry is cancelled and set again, one at a time."""
        out = super().register_with_event_loop(loop)
        if self.sem_tracker is not None:
            if self._tracker_check is not None:
                self._tracker_check.cancel()
            self._tracker_check = loop.call_repeatedly(tracker.CHECK_EVERY_S,
                                                       self.sem_tracker.check)
        return out

    def cap_children(self, children: int) -> None:
        """children_per_gpu pool children per GPU (workers/child/devices.py pool_children): growing
        the pool past `children` is refused with a log message. No limit when it is 0 (a
        CPU-only host)."""
        self.max_children = children if children > 0 else None

    def grow_within_cap(self, n: int = 1) -> Any:
        cap = self.max_children
        if cap is not None and self.num_processes + n > cap:
            logger.error("refusing to grow the pool from %d to %d children: this host runs "
                         "%d (children_per_gpu per GPU); add a worker host instead",
                         self.num_processes, self.num_processes + n, cap)
            return None
        return self._grow(n)

    def keep_every_batch(self) -> None:
        """The pool's flush on a reconnect: nothing dropped. When the broker connection goes,
        Celery flushes the pool (`Consumer.on_close`): it discards every job no child has
        accepted yet and clears what waits to be written to a child, because the broker will
        redeliver those messages. Here every pool job is a batch whose messages the
        dispatcher holds by their leases, which kombu does not restore (fetch.py), so nothing
        would redeliver them: a batch discarded in the milliseconds between its hand-over and
        its child's acceptance never came back, and the dispatcher counted that child busy for
        good, so the worker took no more work. The flush is skipped: batches in flight are
        written, run and settled as after any reconnect."""


def on_child_ready(pool: Any, callback: Callable[[int], Any]) -> bool:
    """`callback(pid)` from now on each time a child of the pool is ready to take work (its
    models loaded), on the event loop. False when the pool has not started, or is not the
    worker's (`Pool`)."""
    inner = _worker_pool(pool)
    if inner is None:
        return False
    inner.on_child_ready = callback
    return True


def hold_ahead(pool: Any, ahead: int) -> bool:
    """Each child of the pool is written up to `ahead` batches beyond the one it runs
    (`HeldBatches`); 0: one at a time, as Celery's fair scheduling does. False when the pool
    has not started, or is not the worker's (`Pool`)."""
    inner = _worker_pool(pool)
    if inner is None:
        return False
    inner._busy_workers.depth = 1 + ahead
    return True


def before_children_start(pool: Any, callback: Callable[[], Any]) -> bool:
    """`callback()` from now on each time before the pool starts children in place of those
    that exited, on the event loop. False when the pool has not started, or is not the
    worker's (`Pool`)."""
    inner = _worker_pool(pool)
    if inner is None:
        return False
    inner.before_children_start = callback
    return True


def _asynpool(pool: Any) -> Any:
    """Celery's AsynPool inside its prefork TaskPool (None before the pool started)."""
    return getattr(pool, "_pool", None)


def _worker_pool(pool: Any) -> Pool | None:
    """The worker's own `Pool` inside `pool`; None before it started, or for another pool."""
    inner = _asynpool(pool)
    return inner if isinstance(inner, Pool) else None


def ready_children(pool: Any) -> set[int]:
    """The pids of the children that take work: started, their models loaded (the pool
    hears from a child only once its initializer, which loads them, returned)."""
    inner = _asynpool(pool)
    if inner is None:
        return set()
    return {p.pid for p in inner._pool if p._is_alive() and p.inqW_fd in inner._all_inqueues}


def free_children(pool: Any) -> tuple[int, int] | None:
    """What the pool's children hold now (`HeldBatches`): how many of those written to hold
    no batch, less the batches handed to the pool and not yet written to a child (its
    outbound buffer); and how many hold one or more. None for a pool that is not the
    worker's, or not started."""
    inner = _worker_pool(pool)
    if inner is None:
        return None
    held = inner._busy_workers.holding() | inner._active_writes
    written_to = inner._all_inqueues
    free = sum(1 for fd in written_to if fd not in held)
    return max(free - len(inner.outbound_buffer), 0), sum(1 for fd in held if fd in written_to)


def serving_children(pool: Any) -> int | None:
    """How many children take work now (`ready_children`); None for a pool that is not
    Celery's prefork pool, or not started (then every one of its processes counts)."""
    if _asynpool(pool) is None:
        return None
    return len(ready_children(pool))


def retire_idle_child(pool: Any, among: set[int], shrink: bool = False) -> int | None:
    """Stop one child of `among` that holds no batch, nor is being written one: it is taken
    out of the children the pool writes to, then terminated as the pool shrinks a child
    (`terminate_controlled`, a SIGKILL here: no error logged), and the pool starts another in
    its place; with `shrink`, none: the pool is one child smaller (a surge's end). Returns its
    pid; None when every one of them is busy."""
    inner = _asynpool(pool)
    if inner is None:
        return None
    held = inner._busy_workers
    busy = (held.holding() if isinstance(held, HeldBatches) else set(held)) \
        | inner._active_writes
    for proc in list(inner._pool):
        fd = proc.inqW_fd
        if proc.pid in among and proc._is_alive() and fd in inner._all_inqueues \
                and fd not in busy:
            inner._all_inqueues.discard(fd)
            if shrink:
                _shrink_by_one(inner)
            proc.terminate_controlled()
            return proc.pid
    return None


def surge(pool: Any) -> bool:
    """One child more, started now beside the others (billiard's `grow`, as `control
    pool_grow` does, then its maintenance, which starts it): past `cap_children` on purpose,
    for the time it takes to load; on a GPU host it lands on a device a child already uses
    (`cuda:<index mod count>`), which holds both copies meanwhile. False when the pool has
    not started."""
    inner = _asynpool(pool)
    if inner is None:
        return False
    inner.grow(1)
    inner.maintain_pool()
    return True


def end_surge(pool: Any, before: set[int]) -> set[int]:
    """A surge undone before its child served (it failed to load, or the reload it was for
    rolled back): the pool one child smaller, and the children started since it had `before`
    as its pids stopped. Returns their pids."""
    inner = _asynpool(pool)
    if inner is None:
        return set()
    _shrink_by_one(inner)
    stopped = set()
    for proc in list(inner._pool):
        if proc.pid not in before and proc._is_alive():
            inner._all_inqueues.discard(proc.inqW_fd)
            proc.terminate_controlled()
            stopped.add(proc.pid)
    return stopped


def _shrink_by_one(inner: Any) -> None:
    """What billiard's `shrink` does to the pool's size, without its choice of child."""
    inner._processes -= 1
    if inner._putlock is not None:
        inner._putlock.shrink()
