"""Task events leave in one publish per few milliseconds. Celery's worker buffers its task
events (received, started, succeeded) and flushes them as one `task.multi` message at the
next turn of the event loop, which under load is nearly one publish per event; here the flush
waits up to `EVENT_FLUSH_S` (or Celery's buffer limit, 24 events), so a batch's events travel
together. Flower and `celery events` read them as before, their timestamps unchanged.

`Consumer` is Celery's worker consumer with that flush: a worker of this service runs it
(`worker_consumer`, set by workers/broker/attach.py's `attach`)."""
from __future__ import annotations

from celery.worker.consumer.consumer import Consumer as CeleryConsumer

# How long a worker's task events may wait to leave together (seconds).
EVENT_FLUSH_S = 0.01

#: The setting that selects it.
WORKER_CONSUMER = f"{__name__}:Consumer"


class Consumer(CeleryConsumer):
    """Celery's consumer, whose buffered task events leave every `EVENT_FLUSH_S`."""

    _flush_due = False

    def on_send_event_buffered(self) -> None:
        if self.hub and not self._flush_due:
            self._flush_due = True
            self.hub.call_later(EVENT_FLUSH_S, self._flush_buffered_events)

    def _flush_buffered_events(self) -> None:
        self._flush_due = False
        self._flush_events()
