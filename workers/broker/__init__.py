"""The worker's side of the broker: kombu's, Celery's and billiard's classes as the worker
extends them, in one room. A worker of this service runs them, selected by those libraries'
own settings (`attach`, called by the worker entry modules workers/main.py and
deliverer/main.py): `broker_transport`, `worker_consumer`, `worker_pool`. Nothing here
patches a library: the API, Flower and `celery -A tasks.cli` run kombu and Celery as shipped.
What the subclasses override or read that the libraries do not promise to keep is listed in
seam.py (and docs/upgrading.md), each checked by a test.

* broker.py: `Broker`, one per worker process, holds the state (its name in Redis, what the
  dispatcher holds, what Redis refused to settle); attach.py: `attach` has a worker run the
  classes below and install its Broker when it starts.
* transport.py: kombu's Redis and Sentinel transports, subclassed; the lease beats on the
  event loop.
* fetch.py, clients.py: their channels, whose fetch moves messages onto the in-flight record
  in one step and blocks on wake-up lists when nothing waits; one Redis client per channel
  pool, no retries on the event loop's connections.
* lua.py, inflight.py: the in-flight record of one worker process, its lease (one key per
  worker, on Redis's clock) and the recovery of what stopped workers held (`InFlight`).
* leases.py: `Leases`, what the dispatcher holds, acknowledged or put back a batch at a time.
* events.py: Celery's consumer, whose task events leave together every few milliseconds.
* intake.py: that consumer's task handler, which takes a fetch's messages in one call, each
  task's strategy a run of them (the batching strategy's `intake`).
* pool.py: Celery's prefork pool, grown no further than the GPUs, not flushed on a reconnect,
  stopping a child with SIGKILL (a child ignores SIGTERM: workers/batching/stopping.py).
* seam.py: the private names all of these rely on, checked when a worker starts.
"""
from workers.broker.attach import attach, broker_of
from workers.broker.broker import Broker, installed
from workers.broker.inflight import InFlight
from workers.broker.leases import Leases

__all__ = ["Broker", "InFlight", "Leases", "attach", "broker_of", "installed"]
