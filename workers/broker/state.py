"""What one worker process holds of the broker's messages beyond kombu's own books."""
from __future__ import annotations

from typing import Any


class BrokerState:
    """The state the adjustments of workers/broker/ read and write, one object per worker
    process (a `Broker`):

    * `held`: delivery tag → message, for each message the dispatcher holds (buffered or
      running); a channel closing must not put these back (unacked.py).
    * `unrecorded`: delivery tag → unacked record, for each message fetched whose record
      Redis refused; this process holds their only copy (fetch.py, unacked.py).
    * `prerecorded`: delivery tags a fetch took and recorded along with another message's
      record, which kombu's own record must skip (fetch.py).
    """

    def __init__(self) -> None:
        self.held: dict[str, Any] = {}
        self.unrecorded: dict[str, str] = {}
        self.prerecorded: set[str] = set()
