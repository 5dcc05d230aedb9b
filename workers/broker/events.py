"""Task events leave in one publish per few tens of milliseconds. Celery's worker buffers its
task events (received, started, succeeded) and flushes them as one `task.multi` message at the
next turn of the event loop, which under load is nearly one publish per event; here the flush
waits up to `EVENT_FLUSH_S`, so a batch's events travel together (a model call takes about as
long: one publish a batch, not one for each of its received, started and succeeded). Flower
and `celery events` read them as before, their timestamps unchanged, at most that much later.

`Consumer` is Celery's worker consumer with that flush (and a fetch's messages taken in one
call: workers/broker/intake.py): a worker of this service runs it (`worker_consumer`, set by
workers/broker/attach.py's `attach`).

`send_task_events` buffers a whole batch's events of one type at once (the dispatcher's
received, started and succeeded), each the event Celery's `Request.send_event` would send, at a
fraction of its cost per job; they leave in one publish with the rest of the buffer, which
waits for up to `BUFFER_LIMIT` events rather than Celery's 24.

`EVENT_SERIALIZER` encodes the worker's event messages with orjson (`select_serializer`, when
a worker starts): the same JSON, as `application/json`, that Flower and `celery events` decode
as ever, at a fraction of the json module's cost; a message holding a value orjson would write
otherwise than kombu's JSON (a datetime, bytes, a subclass of str or int, a value it cannot
write) is written by kombu's JSON, whole. Two it writes otherwise without a word, which no
task or worker event holds: a UUID (its text, where kombu's JSON writes a typed value read
back as a UUID) and a NaN or an infinity (null, where kombu's writes NaN or Infinity)."""
from __future__ import annotations

from time import time
from typing import Any, Iterable

import orjson
from celery.utils.time import utcoffset
from celery.worker.consumer.consumer import Consumer as CeleryConsumer
from kombu.serialization import registry
from kombu.utils import json as kombu_json

from workers.broker.intake import BatchIntake

# How long a worker's task events may wait to leave together (seconds).
EVENT_FLUSH_S = 0.05
# Most task events `send_task_events` leaves in the buffer before it flushes it at once (a
# few full batches' received, started and succeeded: one publish, not one per 24 events).
BUFFER_LIMIT = 512

#: The setting that selects it.
WORKER_CONSUMER = f"{__name__}:Consumer"
#: The worker's event serializer, by the name kombu's registry knows it (`event_serializer`).
EVENT_SERIALIZER = "iq-events-json"
_ORJSON = (orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_SUBCLASS
           | orjson.OPT_PASSTHROUGH_DATACLASS)


def _refuse(value: Any) -> Any:
    raise TypeError(f"left to kombu's JSON: {type(value).__name__}")


def encode_event(message: Any) -> bytes | str:
    """An event message as kombu's JSON would write it, by orjson where orjson writes it alike
    (plain dicts, lists, str, int, float, bool, None)."""
    try:
        return orjson.dumps(message, option=_ORJSON, default=_refuse)
    except TypeError:  # orjson.JSONEncodeError, an int past 64 bits included
        return kombu_json.dumps(message)


def select_serializer(app: Any) -> None:
    """The worker's task events encoded by `encode_event` (a worker's main process, at start).
    Only an encoder is registered: `application/json` is still decoded, and named in kombu's
    errors, as kombu's `json`."""
    if EVENT_SERIALIZER not in registry.name_to_type:
        named = registry.type_to_name.get("application/json")
        registry.register(EVENT_SERIALIZER, encode_event, None, "application/json", "utf-8")
        if named is not None:
            registry.type_to_name["application/json"] = named
    app.conf.event_serializer = EVENT_SERIALIZER


class Consumer(BatchIntake, CeleryConsumer):
    """Celery's consumer, whose buffered task events leave every `EVENT_FLUSH_S`, and whose
    task handler takes a fetch's messages in one call (workers/broker/intake.py)."""

    _flush_due = False

    def on_send_event_buffered(self) -> None:
        if self.hub and not self._flush_due:
            self._flush_due = True
            self.hub.call_later(EVENT_FLUSH_S, self._flush_buffered_events)

    def _flush_buffered_events(self) -> None:
        self._flush_due = False
        self._flush_events()


def send_task_events(eventer: Any, type_: str, jobs: Iterable[tuple[str, dict]]) -> None:
    """One task event of `type_` (`task-received`, ...) for each (task id, fields) of `jobs`,
    as Celery's `EventDispatcher.send` builds it (hostname, utcoffset, pid, a tick of the
    worker's Lamport clock, timestamp, type, `uuid` and the fields) and into the same buffer,
    which the consumer flushes as one `task.multi` message: Flower and `celery events` read
    them as ever. Nothing is sent while the worker's task events are off (`celery control
    disable_events`, `-E` not given) or `eventer` is None."""
    if eventer is None or not eventer.enabled:
        return
    groups = eventer.groups
    if groups and "task" not in groups:
        return
    jobs = list(jobs)
    hostname, pid, offset, now = eventer.hostname, eventer.pid, utcoffset(), time()
    clock = eventer.clock  # a tick each, taken together (what `forward` does, n times)
    with clock.mutex:
        first = clock.value + 1
        clock.value += len(jobs)
    buffer = eventer._group_buffer["task"]
    before = len(buffer)
    buffer.extend({"hostname": hostname, "utcoffset": offset, "pid": pid, "clock": tick,
                   "uuid": uuid, **fields, "timestamp": now, "type": type_}
                  for tick, (uuid, fields) in enumerate(jobs, first))
    if len(buffer) >= BUFFER_LIMIT:
        eventer.flush()
    elif len(buffer) > before and eventer.on_send_buffered:
        eventer.on_send_buffered()
