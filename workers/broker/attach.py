"""`attach`, which has a Celery app's workers run the worker's classes: its kombu transport
(transport.py), its consumer (events.py) and its prefork pool (pool.py), each selected by
Celery's or kombu's own settings, with a Broker (broker.py) of their own."""
from __future__ import annotations

from typing import Any

from celery import Celery, signals
from celery.concurrency import prefork

from workers.broker import events, pool, transport
from workers.broker.broker import Broker


def attach(app: Celery) -> Broker:
    """A Broker for `app`'s workers (`broker_of(app)`), and the worker's classes for them:
    its consumer (`worker_consumer`) and prefork pool (`worker_pool`; a `-P prefork` on the
    command line, which overrides that setting, gets it too), and, when a worker of this app
    starts (`worker_init`, in its main process, before it connects), its kombu transport
    (`broker_transport`), its task events' serializer (`event_serializer`) and the Broker
    installed. Nothing is patched: a process that only
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
        events.select_serializer(app)
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
