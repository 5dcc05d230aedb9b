"""The API's Flask class: Flask, with each hook's and view's kind (plain or `async def`)
looked up once rather than on every call, and each request's body limit given to it when
its context is made.

Flask asks of every function it runs for a request (each `before_request`, `after_request`
and `teardown_request` hook, the view, an error handler) whether it is a coroutine function
(`Flask.ensure_sync`, which Flask's documentation invites an app to override): ~20 times a
request here, each a walk through `inspect`'s checks of a function that never changes."""
from __future__ import annotations

from typing import Any, Callable

from flask import Flask
from flask.ctx import RequestContext

# The most functions whose kind is kept: the app's hooks, views and handlers are a few dozen;
# a function made anew for each request (`after_this_request`) is looked up as Flask does,
# not kept.
KEPT = 512


class Api(Flask):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plain: dict[Callable[..., Any], bool] = {}

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        try:
            plain = self._plain.get(func)
        except TypeError:  # an unhashable callable: as Flask does
            return super().ensure_sync(func)
        if plain is None:
            synced = super().ensure_sync(func)
            if len(self._plain) < KEPT:
                self._plain[func] = synced is func
            return synced
        return func if plain else self.async_to_sync(func)

    def request_context(self, environ: dict) -> RequestContext:
        """The request's context, its `max_content_length` (MAX_CONTENT_LENGTH) set on the
        request: read as Flask's default, it looks `current_app` up twice each time werkzeug
        asks (twice a body read)."""
        context = super().request_context(environ)
        context.request.max_content_length = self.config["MAX_CONTENT_LENGTH"]
        return context
