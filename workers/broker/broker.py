"""`Broker`: what one worker process holds of the broker's messages beyond kombu's own books
(BrokerState), and `attach`, which has a Celery app's workers run the worker's classes:
its kombu transport (transport.py), its consumer (events.py) and its prefork pool (pool.py),
each selected by Celery's or kombu's own settings."""
from __future__ import annotations

from typing import Any

from celery import Celery, signals
from celery.concurrency import prefork

from workers.broker import events, pool, seam, transport
from workers.broker.state import BrokerState, _installed, installed


class Broker(BrokerState):
    """One per worker process: the state the worker's transport, channels and dispatcher
    read and write. `install` makes it this process's; only a worker's main process does
    (`attach`)."""

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


def attach(app: Celery) -> Broker:
    """A Broker for `app`'s workers (`broker_of(app)`), and the worker's classes for them:
    its consumer (`worker_consumer`) and prefork pool (`worker_pool`; a `-P prefork` on the
    command line, which overrides that setting, gets it too), and, when a worker of this app
    starts (`worker_init`, in its main process, before it connects), its kombu transport
    (`broker_transport`) and the Broker installed. Nothing is patched: a process that only
    imports the entry module, the API, Flower and the celery CLI run kombu and Celery as
    shipped."""
    settings = app.conf.iq_settings
    broker = Broker(settings.visibility_timeout_s, settings.heartbeat_interval_s)
    app.conf.iq_broker = broker
    app.conf.worker_consumer = events.WORKER_CONSUMER
    app.conf.worker_pool = pool.WORKER_POOL

    def start(sender: Any = None, **_kw: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        broker.install(getattr(sender, "hostname", None))
        transport.select(app)
        if getattr(sender, "pool_cls", None) in ("prefork", prefork.TaskPool):
            sender.pool_cls = pool.TaskPool

    signals.worker_init.connect(start, weak=False)
    return broker


def broker_of(app: Any) -> Broker:
    broker = getattr(app.conf, "iq_broker", None)
    if broker is None:
        raise RuntimeError("this Celery app has no Broker: its entry module must call "
                           "workers.broker.attach(app)")
    return broker
