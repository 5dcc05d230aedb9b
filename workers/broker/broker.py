"""`Broker`: what one worker process holds of the broker's messages beyond kombu's own books
(BrokerState), and the adjustments of kombu and Celery that read and write it."""
from __future__ import annotations

from typing import Any

from celery import Celery, signals

from workers.broker import clients, events, fetch, pool
from workers.broker.patch import Patch
from workers.broker.state import BrokerState, _installed, installed



class Broker(BrokerState):
    """One per worker process: its state (BrokerState) and the adjustments of kombu's and
    Celery's classes that read and write it. `install` applies them, bound to this object;
    only a worker's main process does (`attach`)."""

    def __init__(self, lease_s: float = 30.0, heartbeat_s: float = 2.0) -> None:
        super().__init__(lease_s, heartbeat_s)
        self._patches: list[Patch] = []

    def __reduce__(self) -> tuple:
        # The app's configuration holds it (`attach`) and is pickled for each spawned pool
        # child: a Broker is one process's, so the child's copy starts empty, uninstalled.
        return Broker, (self.lease_s, self.heartbeat_s)

    def install(self, node: str | None = None) -> Broker:
        """Adjust kombu and Celery for this process, bound to this object; again is a no-op.
        Refused while another Broker's adjustments are in place. `node`: the worker's node
        name (Celery's hostname)."""
        current = installed()
        if current is self:
            return self
        if current is not None:
            raise RuntimeError("another Broker's adjustments are installed in this process")
        if node:
            self.name(node)
        patches = [*clients.patches(), *fetch.patches(), *events.patches(),
                   *pool.patches()]
        applied: list[Patch] = []
        try:
            for patch in patches:
                patch.apply()
                applied.append(patch)
        except Exception:
            for patch in reversed(applied):
                patch.revert()
            raise
        _installed[:] = [self]
        self._patches = applied
        return self

    def uninstall(self) -> None:
        """kombu and Celery as shipped again (tests)."""
        for patch in reversed(self._patches):
            patch.revert()
        self._patches = []
        if installed() is self:
            _installed.clear()




def attach(app: Celery) -> Broker:
    """A Broker for `app`'s workers (`broker_of(app)`), installed when a worker of this app
    starts (`worker_init`: in its main process, before it connects). Its pool children, the
    API, Flower and the celery CLI run kombu and Celery as shipped."""
    settings = app.conf.iq_settings
    broker = Broker(settings.visibility_timeout_s, settings.heartbeat_interval_s)
    app.conf.iq_broker = broker

    def install(sender: Any = None, **_kw: Any) -> None:
        if getattr(sender, "app", None) is app:
            broker.install(getattr(sender, "hostname", None))

    signals.worker_init.connect(install, weak=False)
    return broker


def broker_of(app: Any) -> Broker:
    broker = getattr(app.conf, "iq_broker", None)
    if broker is None:
        raise RuntimeError("this Celery app has no Broker: its entry module must call "
                           "workers.broker.attach(app)")
    return broker
