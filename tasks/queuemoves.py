"""A model's queue changed by a reload (`queue:` in the models file): what waits on the old
queue goes to the new one, so that no job is stranded on a queue no worker consumes.

Moving, rather than refusing the reload until the old queue drains: a drain needs a worker
that still consumes the old queue while the API already sends to the new one, and it never
ends under load from an API process not reloaded yet; a move is what an operator who renames a
queue expects, and it keeps each job's place (its priority list, and ahead of the jobs sent to
the new queue since, which are younger).

    record   a worker taking a models file (workers/batching/reload.py apply), or `make
             reload` finding jobs not final on a queue their model no longer has
             (scripts/reload_moved.py), writes old queue -> new queue in QUEUE_MOVES_KEY; a
             queue that a file gives to a model again is no longer moved from.
    MOVE     every worker's tick, and `make reload` once done: for each move whose old queue
             no worker consumes any more (no beat in its consuming set for a heartbeat's
             ttl), the messages of each of its priority lists go to the tail of the same list
             of the new queue (served next, oldest last: order kept), each job's record
             pointed at its new list (`list`: the reconciler and the removed-model sweep read
             it), a wake-up token for the new queue's workers. One script: a message is on one
             list at every instant.
    forward  what a worker hands back after the switch (its buffer, a reaped worker's
             in-flight messages, the reconciler's requeue: workers/broker/lua.py) goes to
             the new queue at once, its record pointed there too.

The depth readings (the API's `iq_queue_depth`, its depth limit) count a queue's old queues'
lists with its own while anything waits there (`waiting`), so that a queue's depth does not
read 0 while its jobs wait to be moved."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import redis

from tasks.keys import CONSUMING_KEY, JOB_PREFIX, QUEUE_MOVES_KEY, wake_key
from tasks.lua import script
from tasks.names import PRIORITY_SEP, queue_lists

# Most messages one MOVE call takes (a script blocks Redis while it runs); `move` calls it
# again while it moved that many.
MOVE_CHUNK = 500
# Most moves a chain of renames is followed through (A -> B -> C ...).
MAX_HOPS = 8


# What the moves' scripts are given (tasks/lua/queue_move.lua, _queue_forward.lua), by the
# names they use.
CONSTANTS = {"SEP": PRIORITY_SEP, "MOVES": QUEUE_MOVES_KEY, "MAX_HOPS": MAX_HOPS,
             "JOB_PREFIX": JOB_PREFIX, "CONSUMING_PREFIX": CONSUMING_KEY + ":",
             "WAKE_PREFIX": wake_key("")}
# Lua helpers for a script that declares `SEP` (the priority separator) before them:
# `forward(list)`, the list a message of `list` belongs on now; `relist(message, from, to)`,
# its job's record pointed at `to` when it named `from` (workers/broker/lua.py's too).
FORWARD_LUA = script("_queue_forward", {k: v for k, v in CONSTANTS.items() if k != "SEP"})
# Every old queue no worker consumes, its messages to its new queue (tasks/lua/queue_move.lua).
MOVE = script("queue_move", CONSTANTS)


@dataclass(frozen=True)
class Moved:
    old: str
    new: str
    jobs: int  # moved by this call
    consumed: bool  # a worker still consumes the old queue: nothing moved yet


def changed_queues(before: Mapping[str, str], after: Mapping[str, str]) -> dict[str, str]:
    """The moves a models file change makes (`before`, `after`: model -> queue): old queue ->
    new queue, for each model kept whose queue changed and whose old queue no model has now."""
    now = set(after.values())
    return {before[m]: after[m] for m in before.keys() & after.keys()
            if before[m] != after[m] and before[m] not in now}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class QueueMoves:
    """The moves over one Redis client."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._move = client.register_script(MOVE)

    def record(self, moves: Mapping[str, str], queues: Iterable[str]) -> None:
        """`moves` (old queue -> new queue) from now on; `queues`, every queue of the models
        file in force, moved from no more (one step)."""
        queues = sorted(set(queues) - set(moves))
        with self.client.pipeline() as pipe:
            if queues:
                pipe.hdel(QUEUE_MOVES_KEY, *queues)
            if moves:
                pipe.hset(QUEUE_MOVES_KEY, mapping=dict(moves))
            pipe.execute()

    def move(self, consumer_ttl_s: float) -> list[Moved]:
        """Move what waits on every old queue no worker consumes (a beat within
        `consumer_ttl_s`); per move, how many jobs this call moved."""
        suffixes = [name[len("q"):] for name in queue_lists("q")]
        total: dict[tuple[str, str], list] = {}
        while True:
            out = self._move(keys=[QUEUE_MOVES_KEY],
                             args=[consumer_ttl_s, MOVE_CHUNK, *suffixes])
            moved = 0
            for i in range(0, len(out), 4):
                key = (_text(out[i]), _text(out[i + 1]))
                entry = total.setdefault(key, [0, False])
                entry[0] += int(out[i + 2])
                entry[1] = _text(out[i + 3]) == "1"
                moved += int(out[i + 2])
            if moved < MOVE_CHUNK:
                break
        return [Moved(old, new, n, consumed) for (old, new), (n, consumed) in total.items()]

    def waiting(self, queues: Iterable[str]) -> dict[str, int]:
        """Messages waiting for each of `queues`: on its lists, and on those of the queues
        moved to it whose messages are not moved yet. One round trip, and a second only while
        a moved-from queue holds any."""
        queues = list(queues)
        with self.client.pipeline(transaction=False) as pipe:
            for queue in queues:
                for name in queue_lists(queue):
                    pipe.llen(name)
            pipe.hgetall(QUEUE_MOVES_KEY)
            *lengths, moves = pipe.execute()
        found = iter(lengths)
        out = {queue: sum(next(found) for _ in queue_lists(queue)) for queue in queues}
        moves = {_text(k): _text(v) for k, v in (moves or {}).items()}
        into = {old: _destination(old, moves) for old in moves}
        counted = [old for old, new in into.items() if new in out]
        if counted:
            with self.client.pipeline(transaction=False) as pipe:
                for old in counted:
                    for name in queue_lists(old):
                        pipe.llen(name)
                found = iter(pipe.execute())
            for old in counted:
                out[into[old]] += sum(next(found) for _ in queue_lists(old))
        return out


def _destination(queue: str, moves: Mapping[str, str]) -> str:
    for _ in range(MAX_HOPS):
        if queue not in moves:
            break
        queue = moves[queue]
    return queue
