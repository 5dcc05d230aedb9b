"""The dynamic batching policy, free of Celery so it can be tested without a broker.

A worker's main process buffers jobs per model and hands batches to idle pool children:

* A batch is never empty and holds at most `max_batch_size` items (a job's inputs are its
  items), except that a single job larger than that forms a batch of its own; the child then
  runs it as several model calls.
* When a child is idle and work is buffered, a batch leaves at once if it is full, if its
  oldest job has waited `max_wait_ms`, or if no child is busy at all (a lone job on an idle
  worker must not wait out a window: nothing else is running that could be batched with it).
  Otherwise it leaves no later than the oldest job's deadline.
* While every child is busy, jobs only accumulate; the moment a child frees up it takes
  everything waiting, up to `max_batch_size` items, without waiting any longer.
* Jobs the caller says to discard (revoked, expired) are dropped when a batch is formed.
* Within a model, higher-priority jobs (lower number) leave first, FIFO within a priority:
  prefetched jobs are reordered here, so priority holds even with a full buffer.
* A job marked `alone` (its batch lost its child: workers/batching/isolation.py) leaves in a
  batch of its own.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Pending:
    job: Any
    items: int
    arrived: float
    priority: int = 0
    alone: bool = False


@dataclass
class Batch:
    model: str
    jobs: list[Pending]

    @property
    def items(self) -> int:
        return sum(p.items for p in self.jobs)


@dataclass
class ModelBuffer:
    model: str
    max_batch_size: int
    max_wait_s: float
    queue: deque[Pending] = field(default_factory=deque)
    items: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) \
                or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s!r}")

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, pending: Pending) -> None:
        self.queue.append(pending)
        self.items += pending.items

    @property
    def oldest(self) -> float:
        return self.queue[0].arrived

    @property
    def deadline(self) -> float:
        return self.oldest + self.max_wait_s

    def ready(self, now: float, worker_idle: bool, freed: bool, full_only: bool = False) -> bool:
        if full_only:
            return bool(self.queue) and self.items >= self.max_batch_size
        return bool(self.queue) and (
            freed or worker_idle or self.items >= self.max_batch_size or now >= self.deadline
        )

    def take(self, discard: Callable[[Any], bool]) -> list[Pending]:
        """Up to max_batch_size items, by priority then arrival; at least one job if any
        survives `discard`; a job marked `alone` only by itself."""
        order = sorted(self.queue, key=lambda p: (p.priority, p.arrived))
        taken: list[Pending] = []
        gone: set[int] = set()
        count = 0
        for head in order:
            if taken and head.alone:
                continue  # it waits for a batch of its own
            if taken and count + head.items > self.max_batch_size:
                break
            gone.add(id(head))
            if discard(head.job):
                continue
            taken.append(head)
            count += head.items
            if head.alone or count >= self.max_batch_size:
                break
        self.queue = deque(p for p in self.queue if id(p) not in gone)
        self.items = sum(p.items for p in self.queue)
        return taken

    def remove_if(self, pred: Callable[[Any], bool]) -> list[Pending]:
        return self.remove_where(lambda p: pred(p.job))

    def remove_where(self, pred: Callable[[Pending], bool]) -> list[Pending]:
        kept: deque[Pending] = deque()
        removed: list[Pending] = []
        for p in self.queue:
            (removed if pred(p) else kept).append(p)
        self.queue = kept
        self.items = sum(p.items for p in kept)
        return removed


def _keep(_job: Any) -> bool:
    return False


class BatchScheduler:
    """Which buffered jobs go to which idle child, and when to look again."""

    def __init__(self) -> None:
        self.buffers: dict[str, ModelBuffer] = {}
        # Models whose jobs wait, whatever their buffer's deadline: a reload's new models
        # while a child on the previous file, which lacks them, may be handed a batch.
        self.held: set[str] = set()

    def add_model(self, model: str, max_batch_size: int, max_wait_s: float) -> None:
        """A model's buffer; for a model it has already, its new limits (a reload), the jobs
        it holds kept."""
        held = self.buffers.get(model)
        self.buffers[model] = ModelBuffer(model, max_batch_size, max_wait_s)
        if held is not None:
            self.buffers[model].queue, self.buffers[model].items = held.queue, held.items

    def remove_model(self, model: str) -> list[Pending]:
        """A model's buffer gone (a reload removed the model): what it held."""
        held = self.buffers.pop(model, None)
        return list(held.queue) if held is not None else []

    def add(self, model: str, job: Any, items: int, now: float, priority: int = 0,
            alone: bool = False) -> None:
        self.buffers[model].add(Pending(job, max(int(items), 1), now, priority, alone))

    def __len__(self) -> int:
        return sum(len(b) for b in self.buffers.values())

    def batches(
        self,
        now: float,
        idle: int,
        busy: int,
        freed: int = 0,
        discard: Callable[[Any], bool] = _keep,
        full_only: bool = False,
    ) -> list[Batch]:
        """Batches to hand out now. `idle`/`busy`: children free and working; `freed`: how
        many of the idle children have just finished (they take what waits, without delay);
        `full_only`: only full batches (those handed to a busy child ahead of time)."""
        out: list[Batch] = []
        while idle > 0:
            worker_idle = busy == 0
            ready = [b for b in self.buffers.values()
                     if b.model not in self.held
                     and b.ready(now, worker_idle, freed > 0, full_only)]
            if not ready:
                break
            buf = min(ready, key=lambda b: b.oldest)  # the longest-waiting model goes first
            jobs = buf.take(discard)
            if not jobs:
                continue  # everything at the head was discarded; look again
            out.append(Batch(buf.model, jobs))
            idle -= 1
            busy += 1
            freed = max(freed - 1, 0)
        return out

    def next_deadline(self) -> float | None:
        deadlines = [b.deadline for b in self.buffers.values()
                     if b.queue and b.model not in self.held]
        return min(deadlines) if deadlines else None

    def remove(self, job: Any) -> bool:
        """`job` out of its buffer; False when it is in none (it was handed out)."""
        return any(b.remove_if(lambda j: j is job) for b in self.buffers.values())

    def drain(self, keep_alone: bool = False) -> list[Pending]:
        """Everything buffered, removed (used when the broker connection is replaced); with
        `keep_alone`, the jobs marked `alone` stay (they run alone here: a poison input must
        not meet batch-mates on another worker)."""
        out: list[Pending] = []
        for b in self.buffers.values():
            out.extend(b.remove_where(lambda p: not (keep_alone and p.alone)))
        return out
