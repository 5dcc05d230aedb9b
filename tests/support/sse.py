"""A minimal reader of the API's event streams for tests, kept apart from the client's own
(client/inference_queue_client/sse.py), so that each checks the other."""
from __future__ import annotations

import json
from typing import Iterable


def events_of(lines: Iterable[str]) -> list[tuple[str, str, dict]]:
    """(event, id, the job its data carries) for each event of a text/event-stream."""
    out, fields = [], {}
    for line in lines:
        if line == "":
            if "data" in fields:
                out.append((fields.get("event", "message"), fields.get("id", ""),
                            json.loads(fields["data"])))
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            fields[name] = value
    return out
