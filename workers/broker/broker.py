"""`Broker`: what one worker process holds of the broker's messages beyond kombu's own books
(BrokerState), and the adjustments of kombu and Celery that read and write it."""
from __future__ import annotations

from typing import Any

from celery import Celery, signals
from kombu.transport import redis as kombu_redis

from workers.broker import clients, events, fetch, unacked
from workers.broker.patch import Patch
from workers.broker.state import BrokerState

_OWNER_ATTR = "_iq_broker"


class Broker(BrokerState):
    """One per worker process: its state (BrokerState) and the adjustments of kombu's and
    Celery's classes that read and write it. `install` applies them, bound to this object;
    only a worker's main process does (`attach`)."""

    def __init__(self) -> None:
        super().__init__()
        self._patches: list[Patch] = []

    def __reduce__(self) -> tuple:
        # The app's configuration holds it (`attach`) and is pickled for each spawned pool
        # child: a Broker is one process's, so the child's copy starts empty, uninstalled.
        return Broker, ()

    def install(self) -> Broker:
        """Adjust kombu and Celery for this process, bound to this object; again is a no-op.
        Refused while another Broker's adjustments are in place."""
        current = installed()
        if current is self:
            return self
        if current is not None:
            raise RuntimeError("another Broker's adjustments are installed in this process")
        patches = [*clients.patches(), *unacked.patches(self), *fetch.patches(self),
                   *events.patches()]
        applied: list[Patch] = []
        try:
            for patch in patches:
                patch.apply()
                applied.append(patch)
        except Exception:
            for patch in reversed(applied):
                patch.revert()
            raise
        setattr(kombu_redis.QoS.append, _OWNER_ATTR, self)
        self._patches = applied
        return self

    def uninstall(self) -> None:
        """kombu and Celery as shipped again (tests)."""
        for patch in reversed(self._patches):
            patch.revert()
        self._patches = []


def installed() -> Broker | None:
    """The Broker whose adjustments this process runs with, if any."""
    return getattr(kombu_redis.QoS.append, _OWNER_ATTR, None)


def attach(app: Celery) -> Broker:
    """A Broker for `app`'s workers (`broker_of(app)`), installed when a worker of this app
    starts (`worker_init`: in its main process, before it connects). Its pool children, the
    API, Flower and the celery CLI run kombu and Celery as shipped."""
    broker = Broker()
    app.conf.iq_broker = broker

    def install(sender: Any = None, **_kw: Any) -> None:
        if getattr(sender, "app", None) is app:
            broker.install()

    signals.worker_init.connect(install, weak=False)
    return broker


def broker_of(app: Any) -> Broker:
    broker = getattr(app.conf, "iq_broker", None)
    if broker is None:
        raise RuntimeError("this Celery app has no Broker: its entry module must call "
                           "workers.broker.attach(app)")
    return broker
