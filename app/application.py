"""The API's Flask class: Flask, with each hook's and view's kind (plain or `async def`)
looked up once rather than on every call, and each request's body limit given to it when
its context is made.

Flask asks of every function it runs for a request (each `before_request`, `after_request`
and `teardown_request` hook, the view, an error handler) whether it is a coroutine function
(`Flask.ensure_sync`, which Flask's documentation invites an app to override): ~20 times a
request here, each a walk through `inspect`'s checks of a function that never changes."""
from __future__ import annotations

import re
from typing import Any, Callable

from flask import Flask, Response
from flask.ctx import RequestContext
from flask.sessions import NullSession, SessionInterface
from werkzeug.datastructures import Headers

# The most functions whose kind is kept: the app's hooks, views and handlers are a few dozen;
# a function made anew for each request (`after_this_request`) is looked up as Flask does,
# not kept.
KEPT = 512


# A Location that werkzeug's `iri_to_uri` gives back unchanged: a path of the app's own
# ("/v1/jobs/<id>"), not "//" (a host), made of the characters it leaves unquoted in a path
# (urllib's always-safe ones and "%!$&'()*+,/:;=@"), without a query or a fragment.
_URI_PATH = re.compile(r"/(?!/)[A-Za-z0-9_.~%!$&'()*+,/:;=@-]*")
# Header names, as the API writes them, that werkzeug leaves as they are in an answer (neither
# Location, Content-Location nor Content-Length, in any spelling): passed over at a glance.
_KEPT_AS_IS = frozenset({"Content-Type", "X-Request-ID", "Preference-Applied", "Retry-After",
                         "Cache-Control", "Vary", "Allow", "WWW-Authenticate", "Link"})


class Answer(Response):
    """The API's answers: Flask's, with a Location that is already a URI left as it is.
    werkzeug reads every answer's Location through `iri_to_uri` (urllib's split, three
    quotes and a join: ~35 calls a submit) to quote what an IRI may hold; the API's own
    Locations are paths of ASCII it would leave unchanged (`_URI_PATH`). Such a Location is
    out of the headers while werkzeug makes the answer's (`get_wsgi_headers`), then put back
    where it was, in them and in the answer's; any other, and a Location werkzeug would make
    absolute (`autocorrect_location_header`) or whose status drops headers (1xx, 204, 304),
    go through werkzeug as before."""

    def get_wsgi_response(self, environ: dict) -> tuple[Any, str, list[tuple[str, str]]]:
        """werkzeug's `(app_iter, status, headers)`, the headers as the answer holds them when
        werkzeug would give them back unchanged: every API answer (a Content-Length set with its
        body, no Content-Location, at most one `Location` that is already a URI, a status that
        keeps its headers). werkzeug copies them into a new Headers (~25 calls, each value
        checked again) and walks it for those three names; here one walk over the answer's own
        headers, which are werkzeug's checked values already. Any other answer goes through
        `get_wsgi_headers` as before (tests/unit/test_answer.py compares the two)."""
        status = self.status_code
        if 100 <= status < 200 or status in (204, 304) or self.autocorrect_location_header:
            return super().get_wsgi_response(environ)
        sized = located = False
        for key, value in self.headers:
            if key in _KEPT_AS_IS:
                continue
            if key == "Content-Length" and not sized:
                sized = True
            elif key == "Location" and not located and _URI_PATH.fullmatch(value):
                located = True
            elif key.lower() in ("location", "content-location", "content-length"):
                return super().get_wsgi_response(environ)  # another spelling, or twice
        if not sized:
            return super().get_wsgi_response(environ)
        return self.get_app_iter(environ), self.status, list(self.headers)

    def get_wsgi_headers(self, environ: dict) -> Headers:
        own, at = self.headers, None
        for index, (key, value) in enumerate(own):
            if key.lower() == "location":
                if at is not None:  # two: werkzeug keeps the last, in the first's place
                    return super().get_wsgi_headers(environ)
                at, location = index, value
        status = self.status_code
        if at is None or self.autocorrect_location_header or 100 <= status < 200 or \
                status in (204, 304) or not _URI_PATH.fullmatch(location):
            return super().get_wsgi_headers(environ)
        pair = [own[at]]
        del own[at]
        try:
            headers = super().get_wsgi_headers(environ)
        finally:
            own[at:at] = pair
        headers[at:at] = pair
        return headers


class NoSession(SessionInterface):
    """The API keeps no sessions (nothing in app/ reads Flask's `session`; a caller is its API
    key): each request gets the one null session, which refuses any write, rather than
    Flask's default looking for a secret key and making a null session a request."""

    NULL = NullSession()

    def open_session(self, app: Flask, request: Any) -> NullSession:
        return self.NULL

    def save_session(self, app: Flask, session: Any, response: Any) -> None:
        """Never called: Flask saves no null session."""


class Api(Flask):
    response_class = Answer
    session_interface = NoSession()

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
