"""A fetch's task messages taken in by one call, not one chain of calls a message.

kombu hands a consumer each message through its own callbacks (the virtual channel's, then
its `Consumer`'s), and Celery's consumer (`create_task_handler`) then builds two promises a
message for the strategy's acknowledgement and rejection, which the batching strategy, whose
requests are settled by the dispatcher's leases, never uses. The worker's fetch
(workers/broker/fetch.py) instead builds a fetch's kombu messages and hands them all to
`many`, which this consumer hangs on its task handler: each message goes to its task's
strategy as before, and a strategy that takes messages together (the batching strategy's
`intake`: workers/batching/strategy.py) takes a run of them in one call. A message of any other
task, or one whose headers name no task, goes through Celery's own handler, as before; one
that a strategy refuses (an invalid task, a body it cannot decode) is answered as Celery's
handler answers it (`on_invalid_task`, `on_decode_error`)."""
from __future__ import annotations

from typing import Any, Callable

from celery.exceptions import InvalidTaskError
from kombu.exceptions import ContentDisallowed, DecodeError
from vine import promise

#: What a strategy's `intake` is handed besides its messages: `refused(message, exc)`, to
#: answer a message it cannot take as Celery's handler would.
Refused = Callable[[Any, Exception], None]
#: The exceptions a strategy's intake answers through `refused`, as Celery's handler does.
REFUSED = (InvalidTaskError, ContentDisallowed, DecodeError)


class BatchIntake:
    """Mixed into Celery's worker consumer (workers/broker/events.py `Consumer`)."""

    strategies: Any
    on_task_message: Any

    def create_task_handler(self, promise: Any = promise) -> Any:
        one = super().create_task_handler(promise)  # type: ignore[misc]
        strategies = self.strategies
        callbacks = self.on_task_message

        def refused(message: Any, exc: Exception) -> None:
            if isinstance(exc, DecodeError):
                self.on_decode_error(message, exc)  # type: ignore[attr-defined]
            else:
                self.on_invalid_task(None, message, exc)  # type: ignore[attr-defined]

        def many(messages: list) -> None:
            """A fetch's messages, in order: each run of messages whose strategies take
            several at once in one call, any other message by Celery's handler."""
            run: list = []
            taking: Any = None
            for message in messages:
                headers = message.headers
                try:
                    # The strategy's way of taking several at once; None: one at a time.
                    took = getattr(strategies[headers["task"]], "intake", None)
                except (TypeError, KeyError):
                    took = None
                if took is not taking and run:
                    taking(run, callbacks, refused)
                    run = []
                taking = took
                if took is None:
                    one(message)
                else:
                    run.append(message)
            if run:
                taking(run, callbacks, refused)

        one.many = many
        return one
