"""The API process's own reading of its queues' depths, so that a submit far from
`max_queue_depth` leaves it unchecked (no LLEN of every priority list in the submit script) and
only one near it has the script check it, exactly. Redis's memory headroom is checked by the
script on every submit: it is what lets the workers finish the jobs already accepted (and
start at all: a worker's first commands are refused on a full Redis), so it is not a limit to
overshoot. A reading of it at most a second old let a single API process fill a small Redis
past its headroom and keep a worker from starting (tests/faults/test_redis_full.py).

The reading is one pipelined round trip (LLEN of every queue list; a second while a queue a
reload renamed still holds jobs, tasks/queuemoves.py), taken on
a thread of its own, started by the first submit that finds the reading older than `max_age_s`
(a quarter second): a few round trips a second per API process, whatever the rate of submits,
and never one a submit waits for (a Redis that does not answer would otherwise cost a submit
two deadlines). Between readings, the process counts its own submits onto each queue. A queue
is near its limit from half of `max_queue_depth` (its reading plus this process's submits
since). Without a reading younger than four times `max_age_s` (none yet, or the last failed),
a submit checks the depth.

What this allows: past that point the check is the script's, exact as before; before it, the
depth would have to cross the rest of the way (half the queue) within one reading's age,
through the other API processes, for a submit to get past the limit unchecked. A queue can then
hold more jobs than `max_queue_depth`: up to P x max_queue_depth / 2 with P API processes
(each lets half the limit through unchecked from one reading of an empty queue): a soft limit
(docs/reliability.md).
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from dataclasses import dataclass, field

import redis

from config.models import ModelSpec
from tasks.queuemoves import QueueMoves

logger = logging.getLogger(__name__)


@dataclass
class Reading:
    taken: float  # time.monotonic()
    depths: dict[str, int]  # per queue
    since: dict[str, int] = field(default_factory=dict)  # this process's submits since


class Gauge:
    def __init__(self, client: redis.Redis, headroom: float, max_age_s: float = 0.25) -> None:
        self.client, self.headroom, self.max_age_s = client, headroom, max_age_s
        self._reading: Reading | None = None
        self._lock = threading.Lock()

    def limits(self, spec: ModelSpec, queues: list[str]) -> tuple[int | None, float | None]:
        """(max depth, memory headroom) for the submit script to check for a job of `spec`:
        the depth None when it is far enough from its limit not to be checked, the headroom
        always. `queues`: every queue the API serves (one reading covers them all). Counts the
        submit."""
        reading = self._current(queues)
        if reading is None or spec.queue not in reading.depths:
            return spec.max_queue_depth, self.headroom
        since = reading.since.get(spec.queue, 0)
        reading.since[spec.queue] = since + 1
        near_depth = reading.depths[spec.queue] + since >= spec.max_queue_depth // 2
        return spec.max_queue_depth if near_depth else None, self.headroom

    def _current(self, queues: list[str]) -> Reading | None:
        """The reading, when it is young enough to serve; a new one is started when it is
        older than `max_age_s` (and none is under way)."""
        reading = self._reading
        age = None if reading is None else time.monotonic() - reading.taken
        if (age is None or age >= self.max_age_s) and self._lock.acquire(blocking=False):
            # Outside the submit's deadline (tasks/redis_deadline.py): no submit waits for it.
            threading.Thread(target=contextvars.Context().run, args=(self._refresh, queues),
                             name="iq-gauge", daemon=True).start()
        return reading if age is not None and age < 4 * self.max_age_s else None

    def _refresh(self, queues: list[str]) -> None:
        try:
            self._reading = self._read(queues)
        except redis.RedisError as exc:
            logger.debug("no reading of the queues' depths (%s): submits check them", exc)
            self._reading = None
        finally:
            self._lock.release()

    def _read(self, queues: list[str]) -> Reading:
        # A queue's own lists and those of a queue a reload moved to it, not moved yet.
        return Reading(time.monotonic(), QueueMoves(self.client).waiting(queues))
