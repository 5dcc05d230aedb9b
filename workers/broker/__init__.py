"""The worker's side of the broker: everything that touches kombu's or Celery's internals, in
one room, each with a test in tests/integration/test_broker.py that fails loudly if an upgrade
changes what it relies on. Only a worker's main process runs with them (`attach`, called by
the worker entry modules workers/main.py and workers/webhook_main.py); the API, Flower and
`celery -A tasks.cli` run kombu and Celery as shipped.

* state.py, broker.py: `Broker`, one per worker process, owns the state (`BrokerState`: its
  name in Redis, what the dispatcher holds, what Redis refused to settle) and installs the
  adjustments bound to it; `attach` makes a worker install its Broker when it starts.
* clients.py: one Redis client per channel pool; no retries on the event loop's connections.
* scripts.py, inflight.py: the in-flight record of one worker process, its lease (one key per
  worker, on Redis's clock) and the recovery of what stopped workers held (`InFlight`).
* fetch.py: a kombu channel whose fetch moves messages onto the in-flight record in one step,
  and blocks on wake-up lists when nothing waits; the lease beats on the event loop.
* leases.py: `Leases`, what the dispatcher holds, acknowledged or put back a batch at a time.
* events.py: task events leave together every few milliseconds.
* pool.py: the prefork pool is grown no further than the GPUs, not flushed on a reconnect, and
  stops a child with SIGKILL (a child ignores SIGTERM: workers/stopping.py).
* patch.py: `Patch`, one replaced method, checked to be where it was.
"""
from workers.broker.broker import Broker, attach, broker_of, installed
from workers.broker.inflight import InFlight
from workers.broker.leases import Leases

__all__ = ["Broker", "InFlight", "Leases", "attach", "broker_of", "installed"]
