"""The worker's side of the broker: everything that touches kombu's or Celery's internals, in
one room, each with a test in tests/integration/test_broker.py that fails loudly if an upgrade
changes what it relies on. Only a worker's main process runs with them (`attach`, called by
the worker entry modules workers/main.py and workers/webhook_main.py); the API, Flower and
`celery -A tasks.cli` run kombu and Celery as shipped.

* state.py, broker.py: `Broker`, one per worker process, owns the state (`BrokerState`: what
  the dispatcher holds, what Redis refused to record, what a fetch took ahead) and installs
  the adjustments bound to it; `attach` makes a worker install its Broker when it starts.
* clients.py: one Redis client per channel pool; no retries on the event loop's connections.
* fetch.py: a fetched message is never dropped before its record (`Broker.unrecorded`); one
  script records it and takes what waits behind it (`Broker.prerecorded`).
* unacked.py: `Unacked`, kombu's unacked records by delivery tag (renew, ack, restore); a
  closing channel leaves what the dispatcher holds (`Broker.held`).
* leases.py: `Leases`, what the dispatcher holds stays invisible to other workers while it
  lives, and no longer.
* events.py: task events leave together every few milliseconds.
* pool.py: the prefork pool is grown no further than the GPUs, and not flushed on a reconnect.
* patch.py: `Patch`, one replaced method, checked to be where it was.
"""
from workers.broker.broker import Broker, attach, broker_of, installed
from workers.broker.leases import Leases
from workers.broker.unacked import Unacked

__all__ = ["Broker", "Leases", "Unacked", "attach", "broker_of", "installed"]
