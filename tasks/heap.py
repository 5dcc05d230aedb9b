"""A long-lived process's garbage collection once it is ready to serve: its start-up objects
set aside (`gc.freeze`), and the youngest generation collected every `YOUNG` allocations
rather than CPython's 700.

An API process or a worker's main process holds ~90,000 objects once started (modules,
classes, Flask's and Celery's tables, the models file), a pool child ~160,000 (torch and its
model), nearly all for its whole life. CPython's full collection walks every one of them each
time the objects that outlived younger collections add up to a quarter of them: under
one-input traffic every few thousand jobs, ~60-140 ms each on this project's 2-core test
machine, during which the process answers no one (a child: its model idle). Frozen, they are
no longer walked (they are never garbage: a frozen object is still freed when its last
reference goes, only a cycle among them would stay, and none is dropped while the process
lives; a child's models are not unloaded in place, a reload replaces the child).

What a request or a job allocates is nearly all freed by reference counting as it ends; a
young collection every 700 allocations walks, again and again, the objects of the requests
still in flight (64 waiting clients' worth). Every 7,000, an API process spent half the time
in them (43 against 92 ms over ~3,000 one-input jobs). What is garbage only as a cycle is
collected as before, a little later.
"""
from __future__ import annotations

import gc

# Allocations (less deallocations) of container objects between two young collections.
YOUNG = 7000

_frozen = False


def freeze_start_up() -> int:
    """The garbage of start-up collected, everything left frozen, young collections every
    `YOUNG` allocations; the number frozen. Once a process: called again (a worker's consumer
    ready again after a reconnect), it leaves alone what came since, jobs' objects among
    them, which stay collectable."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()
        gc.set_threshold(YOUNG, *gc.get_threshold()[1:])
    return gc.get_freeze_count()
