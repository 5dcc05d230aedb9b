"""`Broker`: what one worker process holds of the broker's messages beyond kombu's own books,
and which Broker this process runs with (`installed`)."""
from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from celery.worker import state as worker_state

from workers.broker import seam
from workers.broker.lua import ALIVE_PREFIX, INFLIGHT_PREFIX


class Broker:
    """One per worker process: the state the worker's transport, channels and dispatcher read
    and write. `install` makes it this process's; only a worker's main process does
    (`attach`).

    * `incarnation`: this process's name in Redis (node name, pid and a random part): its
      in-flight hash and its lease are keyed by it (workers/broker/lua.py).
    * `held`: delivery tag -> message, for each message the dispatcher holds (buffered or
      running); a closing channel must not put these back (fetch.py).
    * `to_ack`, `to_restore`: delivery tag -> message, settlements Redis refused, tried again
      every tick (leases.py); their messages stay on the in-flight hash meanwhile.
    * `lease_since`: when (monotonic) this process's lease was last made, at its first beat
      or after it lapsed; None before.
    * `delayed_queues`: queues that have a delayed set (tasks.keys.delayed_key) whose due
      messages a fetch moves onto them.
    * `fetching`: whether this process fetches; the dispatcher turns it off while none of
      its pool children can serve (workers/batching/dispatcher.py), so that what it cannot run
      waits on the queues, for any worker, rather than in its buffer.
    * `children_busy`: every pool child that can serve holds a batch (the dispatcher keeps it);
      a fetch after a wake-up then waits a few milliseconds, to take what arrives meanwhile
      in one round trip (fetch.py `FETCH_HOLD_S`).
    """

    def __init__(self, lease_s: float = 30.0, heartbeat_s: float = 2.0) -> None:
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.held: dict[str, Any] = {}
        self.to_ack: dict[str, Any] = {}
        self.to_restore: dict[str, Any] = {}
        self.lease_since: float | None = None
        self.delayed_queues: set[str] = set()
        self.fetching = True
        self.children_busy = False
        self.name(f"worker@{socket.gethostname()}")

    def name(self, node: str) -> None:
        """This process's node name (Celery's hostname), and so its incarnation."""
        self.node = node
        self.incarnation = f"{node}/{os.getpid()}/{uuid.uuid4().hex[:8]}"

    @property
    def inflight_key(self) -> str:
        return INFLIGHT_PREFIX + self.incarnation

    @property
    def alive_key(self) -> str:
        return ALIVE_PREFIX + self.incarnation

    def known_tags(self) -> set[str]:
        """Every delivery tag this process still has a use for: held by the dispatcher,
        waiting to be settled, or a request Celery has reserved or runs (the webhook
        deliverer's)."""
        for _ in range(5):
            try:  # another thread (the deliverer's pool, the watchdog) may change them
                requests = [*worker_state.reserved_requests, *worker_state.active_requests]
                tags = {*self.held, *self.to_ack, *self.to_restore}
                break
            except RuntimeError:
                continue
        else:
            raise RuntimeError("could not read the tags this worker holds")
        for request in requests:
            tag = getattr(getattr(request, "message", None), "delivery_tag", None)
            if tag is not None:
                tags.add(tag)
        return tags

    def __reduce__(self) -> tuple:
        # The app's configuration holds it (`attach`) and is pickled for each spawned pool
        # child: a Broker is one process's, so the child's copy starts empty, uninstalled.
        return Broker, (self.lease_s, self.heartbeat_s)

    def install(self, node: str | None = None) -> Broker:
        """This process's Broker, once the libraries are checked to still define what the
        worker's classes override (seam.check); again is a no-op. Refused while another
        Broker is installed. `node`: the worker's node name (Celery's hostname)."""
        current = installed()
        if current is self:
            return self
        if current is not None:
            raise RuntimeError("another Broker is installed in this process")
        seam.check()
        if node:
            self.name(node)
        _installed[:] = [self]
        return self

    def uninstall(self) -> None:
        """No Broker in this process again (tests)."""
        if installed() is self:
            _installed.clear()


# The Broker whose adjustments are in place in this process.
_installed: list[Broker] = []


def installed() -> Broker | None:
    """The Broker whose adjustments this process runs with, if any."""
    return _installed[0] if _installed else None
