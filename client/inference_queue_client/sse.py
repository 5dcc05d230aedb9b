"""Server-Sent Events as the API streams a job's moves (GET /v1/jobs/<id>/events): the
`text/event-stream` format read line by line, as the HTML standard says an EventSource reads
it (only the parts this API uses: `event`, `id`, `data`, comments)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator


@dataclass
class Event:
    event: str = "message"
    id: str | None = None
    data: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join(self.data)


def read_events(lines: Iterable[str]) -> Iterator[Event]:
    """Each event of a stream, given its lines (without their line ends); a blank line ends
    an event, a line starting with ":" is a comment (a heartbeat)."""
    current = Event()
    for line in lines:
        if not line:
            if current.data:
                yield current
            current = Event()
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            current.event = value
        elif name == "data":
            current.data.append(value)
        elif name == "id":
            current.id = value
