"""Task events leave in one publish per few milliseconds. Celery's worker buffers its task
events (received, started, succeeded) and flushes them as one `task.multi` message at the
next turn of the event loop, which under load is nearly one publish per event; here the flush
waits up to `EVENT_FLUSH_S` (or Celery's buffer limit, 24 events), so a batch's events travel
together. Flower and `celery events` read them as before, their timestamps unchanged."""
from __future__ import annotations

from typing import Any, Callable

from celery.worker.consumer.consumer import Consumer

from workers.broker.patch import Patch

# How long a worker's task events may wait to leave together (seconds).
EVENT_FLUSH_S = 0.01


def _flush_every_few_ms(_original: Callable[..., Any]) -> Callable[..., Any]:
    def on_send_event_buffered(self: Any) -> None:
        if self.hub and not getattr(self, "_iq_flush_due", False):
            self._iq_flush_due = True
            self.hub.call_later(EVENT_FLUSH_S, _flush, self)

    return on_send_event_buffered


def _flush(consumer: Any) -> None:
    consumer._iq_flush_due = False
    consumer._flush_events()


def patches() -> list[Patch]:
    return [Patch(Consumer, "on_send_event_buffered", _flush_every_few_ms)]
