"""The end of a reload (scripts/reload.py, once every live process serves the new models
file), beside scripts/reload_removed.py: the jobs still waiting on a queue that the file took
their model off (`queue:` changed) go to the model's new queue (tasks/queuemoves.py). The
workers do it as they take the file, and every tick since; this step finds such queues
also when no running worker took the file from an earlier one (each stopped, to be started on
the new file), from the jobs not final yet whose record names a queue their model no longer
has, and reloads of the file in place (no previous file to compare with) alike. It says how
many it moved, and which old queue a worker still consumes (its jobs move once none does)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import redis

from config import ConfigError, Settings
from config.models import parse_models, revision_of
from scripts.reload_removed import pending_queues
from tasks.queuemoves import QueueMoves


def move_queued_jobs(client: redis.Redis, settings: Settings, target: Path, revision: str,
                     say: Callable[[str], None]) -> bool:
    """Move the jobs waiting on queues the models file at `target` (of `revision`) took
    their model off, saying how many; False when Redis refused (the workers move them still,
    and the next reload)."""
    try:
        content = target.read_bytes()
        if revision_of(content) != revision:
            return True  # changed since: scripts/reload_removed.py says so
        models = parse_models(target, content)
        queues = {name: spec.queue for name, spec in models.items()}
        moves = {queue: queues[model] for model, found in pending_queues(client).items()
                 if model in queues for queue in found
                 if queue != queues[model] and queue not in queues.values()}
        mover = QueueMoves(client)
        if moves:
            mover.record(moves, queues.values())
        moved = mover.move(settings.heartbeat_ttl_s)
    except (OSError, ConfigError):
        return True  # scripts/reload_removed.py says why
    except redis.RedisError as exc:
        say(f"the jobs waiting on renamed queues could not be moved (Redis: {exc}): the "
            "workers move them, and `make reload` again")
        return False
    for m in sorted(moved, key=lambda m: m.old):
        if m.consumed:
            say(f"queue {m.old}: a worker still consumes it; what waits there moves to "
                f"queue {m.new} once none does")
        elif m.jobs:
            say(f"jobs waiting on queue {m.old}: {m.jobs} moved to queue {m.new}")
    return True
