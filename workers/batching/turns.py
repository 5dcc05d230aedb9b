"""A reload's turns (issue 29): workers that serve the same queue take the new models one after
another, as replicas do in a rolling update, so that while one worker's new child loads
another keeps serving the queue with the old version.

A worker needs a turn only to retire its last serving child (a worker with another child
serving keeps serving meanwhile, workers/batching/reload.py). A turn is one key per queue the
worker consumes (tasks/keys.py `reload_turn_key`) naming the worker; all of them are taken in one
script, or none is (so two workers with overlapping queues never each hold half of what the other
needs). A worker alone on its queues finds them free and goes at once. The holder keeps its turn
while its replacement loads, renewing it every tick, and gives it back once the new child is up
(the pool's WORKER_UP, after the child's initializer loaded the models), when its reload rolls back
(workers/batching/reload.py), or when it stops (a warm shutdown gives it back at once: the next
worker need not wait out the TTL). Each key lapses `ttl_s` after the holder's last renewal, so that
a holder that died or whose event loop is stuck delays the others by that much, never for ever; a
holder whose keys lapsed (or were taken since) learns it at its next renewal and no longer counts
itself the holder."""
from __future__ import annotations

import logging
from time import monotonic

import redis

from tasks.keys import reload_turn_key
from tasks.lua import script

logger = logging.getLogger(__name__)

# The turn taken on every queue of the worker, or on none (tasks/lua/turn_take.lua: '' when
# taken, else the holder of the first key that is not free), and kept or given back
# (turn_keep.lua: how many keys were still the worker's).
_TAKE = script("turn_take")
_KEEP = script("turn_keep")


class Turn:
    """One per worker (`Reloader.turn`). `worker`: its node name; `retry_s`: how often it asks
    again while another worker holds the turn."""

    def __init__(self, client: redis.Redis, worker: str, ttl_s: float, retry_s: float) -> None:
        self.client, self.worker = client, worker
        self.ttl_ms, self.retry_s = max(int(ttl_s * 1000), 1), retry_s
        self.keys: list[str] = []  # held: the turn keys taken
        self.waiting_for = ""  # the worker that held it at the last refusal
        self._asked = float("-inf")
        self._take = client.register_script(_TAKE)
        self._keep = client.register_script(_KEEP)

    @property
    def held(self) -> bool:
        return bool(self.keys)

    def take(self, queues: list[str]) -> bool:
        """Whether this worker has the turn on every one of `queues` (taken now, or held
        already). No more than one ask each `retry_s` while refused; a Redis error is a
        refusal (the worker keeps its child serving, and asks again)."""
        if self.keys:
            return True
        if monotonic() - self._asked < self.retry_s:
            return False
        self._asked = monotonic()
        keys = [reload_turn_key(q) for q in sorted(set(queues))]
        try:
            holder = self._take(keys=keys, args=[self.worker, self.ttl_ms]) if keys else ""
        except redis.RedisError as exc:
            logger.warning("reload: could not ask for this worker's turn: %s", exc)
            return False
        if holder:
            if holder != self.waiting_for:
                logger.info("reload: %s reloads its last serving child first; this worker "
                            "keeps serving until its turn", holder)
            self.waiting_for = holder
            return False
        self.keys, self.waiting_for = keys, ""
        logger.info("reload: this worker's turn on %s", ", ".join(sorted(set(queues))) or
                    "(no queue)")
        return True

    def renew(self) -> None:
        """From the worker's tick while it holds the turn. Keys that lapsed (its event loop
        held past the TTL) or were taken by another worker since are no longer its turn: it
        lets go of the rest and asks again when it needs one."""
        mine = self._keep_keys(self.ttl_ms)
        if mine is not None and mine < len(self.keys):
            logger.warning("reload: this worker's turn lapsed (%d of its %d key(s) expired or "
                           "taken by another worker); it asks again for one", len(self.keys) - mine,
                           len(self.keys))
            self._keep_keys(0)
            self.keys = []

    def release(self) -> None:
        if self.keys:
            self._keep_keys(0)
            logger.info("reload: this worker's turn given back")
            self.keys = []

    def _keep_keys(self, ttl_ms: int) -> int | None:
        """How many of its keys were still this worker's (None: Redis did not answer)."""
        if not self.keys:
            return 0
        try:
            return int(self._keep(keys=self.keys, args=[self.worker, ttl_ms]))
        except redis.RedisError as exc:  # it lapses at its TTL
            logger.warning("reload: could not %s this worker's turn: %s",
                           "give back" if ttl_ms == 0 else "renew", exc)
            return None
