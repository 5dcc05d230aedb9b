"""The worker's JSON reads of the broker's messages, through orjson: a fetched message's
envelope (fetch.py) and a task message's body (the batching strategy), each the value kombu's
`loads` would give. kombu's own reads every object of them through a Python hook that only a
typed value needs (`{"__type__": ...}`, which kombu's encoder writes for a datetime, a UUID, a
decimal); a text that has one, or that orjson cannot read, is read by kombu as before."""
from __future__ import annotations

from typing import Any

import orjson
from kombu.utils.json import loads as kombu_loads

JSON = "application/json"


_KOMBUS = object()  # what `_plain` answers for a text only kombu's reader may decode


def _plain(raw: str | bytes) -> Any:
    """`raw` read by orjson, or `_KOMBUS` where it holds a typed value (kombu's `__type__`
    objects) or is JSON orjson refuses."""
    if (b'"__type__"' in raw) if isinstance(raw, bytes) else ('"__type__"' in raw):
        return _KOMBUS
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _KOMBUS


def envelope(raw: str | bytes) -> Any:
    """A message as the broker holds it (properties, headers, its encoded body)."""
    value = _plain(raw)
    return kombu_loads(raw) if value is _KOMBUS else value


def payload(message: Any) -> Any:
    """`message.payload`, its body decoded: through orjson for a JSON body without a typed
    value, else as kombu decodes it (its content type checked against what the worker
    accepts)."""
    body = message.body
    if message.content_type == JSON and isinstance(body, (bytes, str)):
        value = _plain(body)
        if value is not _KOMBUS:
            return value
    return message.payload


_TAG_AT = ('"delivery_tag":"', '"delivery_tag": "')


def tag_in(raw: str) -> str | None:
    """The delivery tag the fetch script found by its text in `raw` (workers/broker/lua/
    _inflight.lua's `tag_of`, the same rule), None where it decoded the message instead: the
    tag a message the worker cannot read is held under on the in-flight hash."""
    if not (raw.startswith("{") and raw.endswith("}")):
        return None
    first = raw.find('"delivery_tag"')
    for text in _TAG_AT:
        if first > 0 and raw.startswith(text, first):
            stop = raw.find('"', first + len(text))
            if stop >= 0 and raw[first - 1] != "\\" and raw.find('"delivery_tag"', stop) < 0:
                tag = raw[first + len(text):stop]
                if "\\" not in tag:
                    return tag
    return None


def readable(raw: str) -> tuple[Any, str] | None:
    """A fetched message's envelope and its delivery tag; None when it is not a message the
    worker can read (not JSON, or no tag in its properties)."""
    try:
        message = envelope(raw)
        tag = message["properties"]["delivery_tag"]
    except (ValueError, TypeError, KeyError):
        return None
    return (message, tag) if isinstance(tag, str) else None

