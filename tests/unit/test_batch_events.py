"""A batch's task events (workers/broker/events.py `send_task_events`) are the events Celery's
own `Request.send_event` would send, into the same buffer, one clock tick each; none while
task events are off; and a full buffer leaves at once. The worker's JSON reads
(workers/broker/decode.py) give what kombu's give, a typed value included."""
from __future__ import annotations

import datetime
import uuid

from celery import Celery
from kombu import Connection
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from workers.broker import decode, events


def dispatcher(**kw):
    app = Celery(set_as_current=False)
    published = []
    eventer = app.events.Dispatcher(Connection("memory://"), hostname="w@test", enabled=True,
                                    buffer_group=["task"], **kw)
    eventer._publish = lambda event, producer, routing_key, **_k: published.append(
        (routing_key, event))
    return eventer, published


def test_a_batchs_events_are_celerys_own_in_one_buffer():
    eventer, published = dispatcher(buffer_limit=10_000)
    eventer.send("task-succeeded", uuid="celery", result="1 output(s)", runtime=0.5)
    events.send_task_events(eventer, "task-succeeded",
                            [(f"job-{i}", {"result": "1 output(s)", "runtime": 0.5})
                             for i in range(3)])
    celerys, *ours = eventer._group_buffer["task"]
    assert len(ours) == 3 and not published  # buffered, for the consumer's flush
    for event in ours:
        assert set(event) == set(celerys)
        assert {k: event[k] for k in event if k not in ("uuid", "clock", "timestamp")} == \
            {k: celerys[k] for k in celerys if k not in ("uuid", "clock", "timestamp")}
    assert [e["uuid"] for e in ours] == ["job-0", "job-1", "job-2"]
    clocks = [e["clock"] for e in (celerys, *ours)]
    assert clocks == sorted(set(clocks))  # a tick each, after Celery's
    eventer.flush()
    [(routing_key, batch)] = published
    assert routing_key == "task.multi" and [e["uuid"] for e in batch][1:] == \
        ["job-0", "job-1", "job-2"]


def test_no_events_while_task_events_are_off():
    eventer, _published = dispatcher()
    eventer.groups = {"worker"}  # `celery control disable_events`
    events.send_task_events(eventer, "task-started", [("a", {})])
    eventer.groups = set()
    eventer.enabled = False
    events.send_task_events(eventer, "task-started", [("b", {})])
    events.send_task_events(None, "task-started", [("c", {})])
    assert not eventer._group_buffer["task"]


def test_a_full_buffer_leaves_at_once_and_a_partial_one_asks_for_a_flush():
    asked = []
    eventer, published = dispatcher(on_send_buffered=lambda: asked.append(1))
    events.send_task_events(eventer, "task-received", [("a", {})])
    assert asked == [1] and not published
    events.send_task_events(eventer, "task-started",
                            [(str(i), {}) for i in range(events.BUFFER_LIMIT)])
    assert len(published) == 1 and len(published[0][1]) == events.BUFFER_LIMIT + 1
    assert not eventer._group_buffer["task"]


class Message:
    content_type = decode.JSON

    def __init__(self, body: bytes) -> None:
        self.body = body

    @property
    def payload(self):
        return kombu_loads(self.body)


def test_the_json_reads_give_what_kombus_give_a_typed_value_included():
    plain = kombu_dumps({"properties": {"delivery_tag": "t", "priority": 3},
                         "headers": {"id": "x", "n": 2**70}, "body": "e30="})
    typed = kombu_dumps([[], {"at": datetime.datetime(2026, 12, 5, 16, 0),
                              "id": uuid.UUID(int=1)}, {}])
    for text in (plain, typed):
        assert decode.envelope(text) == kombu_loads(text)
        assert decode.envelope(text.encode()) == kombu_loads(text)
        assert decode.payload(Message(text.encode())) == kombu_loads(text)
    assert isinstance(decode.payload(Message(typed.encode()))[1]["at"], datetime.datetime)


def test_the_event_serializer_writes_what_kombus_json_writes_by_orjson():
    """A worker's event message (`select_serializer`) is the JSON kombu's `json` writes, as
    `application/json`, by orjson; a value orjson would write otherwise goes to kombu's JSON,
    whole; and `application/json` is still decoded and named as kombu's `json`."""
    from kombu.serialization import dumps, loads, registry

    eventer, published = dispatcher(buffer_limit=10_000)
    events.send_task_events(eventer, "task-received",
                            [(f"job-{i}", {"name": "iq.infer.m", "args": "()", "eta": None,
                                           "retries": 0, "runtime": 0.1 * i})
                             for i in range(3)])
    eventer.flush()
    [(_key, batch)] = published
    app = Celery(set_as_current=False)
    events.select_serializer(app)
    assert app.conf.event_serializer == events.EVENT_SERIALIZER
    content_type, encoding, body = dumps(batch, serializer=app.conf.event_serializer)
    assert (content_type, encoding) == ("application/json", "utf-8")
    assert isinstance(body, bytes)  # orjson's, not the json module's
    assert loads(body, content_type, encoding) == kombu_loads(kombu_dumps(batch)) == batch
    typed = [{"eta": datetime.datetime(2026, 1, 2, 3, 4, 5)}, {"n": 2 ** 70}]
    for value in typed:  # written by kombu's JSON: read back as kombu's own
        assert events.encode_event(value) == kombu_dumps(value)
    assert registry.type_to_name["application/json"] == "json"
