"""The API's Flask class: Flask, with each hook's and view's kind (plain or `async def`)
looked up once rather than on every call, the hooks that run for an endpoint (its
blueprints' and the app's) listed once an endpoint, and each request's body limit given to
it when its context is made.

Flask asks of every function it runs for a request (each `before_request`, `after_request`
and `teardown_request` hook, the view, an error handler) whether it is a coroutine function
(`Flask.ensure_sync`, which Flask's documentation invites an app to override): ~20 times a
request here, each a walk through `inspect`'s checks of a function that never changes."""
from __future__ import annotations

import re
import sys
from typing import Any, Callable, NamedTuple

from flask import Flask, Response
from flask.ctx import RequestContext
from flask.globals import request_ctx
from flask.signals import (appcontext_tearing_down, request_finished, request_started,
                           request_tearing_down)
from flask.sessions import NullSession, SessionInterface
from werkzeug.datastructures import Headers
from werkzeug.routing import Rule

# The most functions whose kind is kept: the app's hooks, views and handlers are a few dozen;
# a function made anew for each request (`after_this_request`) is looked up as Flask does,
# not kept.
KEPT = 512


# A Location that werkzeug's `iri_to_uri` gives back unchanged: a path of the app's own
# ("/v1/jobs/<id>"), not "//" (a host), made of the characters it leaves unquoted in a path
# (urllib's always-safe ones and "%!$&'()*+,/:;=@"), without a query or a fragment.
_URI_PATH = re.compile(r"/(?!/)[A-Za-z0-9_.~%!$&'()*+,/:;=@-]*")
# The most request routes whose match is kept (`Routed`): the app's rules without arguments
# times the methods they take are a few dozen; past this, werkzeug matches as before.
KEPT_ROUTES = 256
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


class Routed(RequestContext):
    """Flask's request context, a request to a rule without arguments (POST /v1/jobs,
    /healthz, /metrics...) matched once (`match_request`, which Flask invites a subclass to
    override). werkzeug's `MapAdapter.match` walks its state machine for the path (~10
    calls a request); its answer for a rule without arguments depends on nothing but what
    it is given: the request's domain part, path, method and whether it is a websocket.
    That answer, once werkzeug has given it after the app's first request (when its rules
    can no longer change), is kept and given again for the same four: its rule alone, since
    its arguments are always none (werkzeug counts a rule's defaults among its arguments),
    each request getting an empty dict of its own for `view_args`. Anything else, every
    error (404, 405, a redirect to the path with its slash) and a rule with arguments
    (/v1/jobs/<job_id>), is werkzeug's own match each time."""

    def match_request(self) -> None:
        adapter, app, request = self.url_adapter, self.app, self.request
        domain = adapter.server_name  # as MapAdapter.match picks it
        if not app.url_map.host_matching and adapter.subdomain is not None:
            domain = adapter.subdomain
        key = (domain, adapter.path_info, adapter.default_method, adapter.websocket)
        rule = app._routes.get(key)
        if rule is not None:
            request.url_rule, request.view_args = rule, {}  # a dict of its own each request
            return
        super().match_request()
        rule = request.url_rule
        if rule is not None and not rule.arguments and app._got_first_request and \
                request.routing_exception is None and len(app._routes) < KEPT_ROUTES:
            app._routes[key] = rule


class Hooks(NamedTuple):
    """What runs around one endpoint's view, in the order Flask runs it: the URL value
    preprocessors and `before_request` hooks of the app, then of each blueprint from the
    outermost in; the `after_request` and `teardown_request` hooks of the innermost
    blueprint out to the app, each's in reverse order of registration."""

    values: tuple[Callable[..., Any], ...]
    before: tuple[Callable[..., Any], ...]
    after: tuple[Callable[..., Any], ...]
    teardown: tuple[Callable[..., Any], ...]


_UNSET = object()  # no exception passed to do_teardown_request: the one being handled


class Api(Flask):
    """Flask, its request's hooks listed once an endpoint (`Hooks`). Flask works out at each
    request, three times (`preprocess_request`, `process_response`, `do_teardown_request`),
    which blueprints the endpoint is in (`request.blueprints`, ~4 calls each), then looks up
    and asks the kind of every hook of the app's and theirs (`ensure_sync`). Hooks cannot
    change once the first request is in (Flask refuses a setup method after it), so the
    list an endpoint gets then stays right. A request matching no rule has the app's alone.
    Flask's signals of a request (started, finished, torn down, its app context torn down)
    are sent when something listens to them, as Flask sends them; with no receiver, blinker's
    `send` and its look-up of receivers are two calls each for nothing."""

    response_class = Answer
    session_interface = NoSession()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plain: dict[Callable[..., Any], bool] = {}
        self._hooks: dict[str | None, Hooks] = {}
        self._routes: dict[tuple, Rule] = {}  # Routed's matches kept: the rule alone

    def hooks(self, request: Any) -> Hooks:
        """The hooks that run for `request`'s endpoint (None: it matched no rule)."""
        rule = request.url_rule
        endpoint = None if rule is None else rule.endpoint
        found = self._hooks.get(endpoint)
        if found is None:
            found = self._list_hooks(request.blueprints)
            if self._got_first_request:
                self._hooks[endpoint] = found
        return found

    def _list_hooks(self, blueprints: list[str]) -> Hooks:
        inward, outward = (None, *reversed(blueprints)), (*blueprints, None)
        sync = self.ensure_sync
        return Hooks(
            tuple(f for name in inward for f in self.url_value_preprocessors.get(name, ())),
            tuple(sync(f) for name in inward for f in self.before_request_funcs.get(name, ())),
            tuple(sync(f) for name in outward
                  for f in reversed(self.after_request_funcs.get(name, ()))),
            tuple(sync(f) for name in outward
                  for f in reversed(self.teardown_request_funcs.get(name, ()))))

    def full_dispatch_request(self) -> Response:
        """Flask's, its `request_started` sent only to receivers."""
        self._got_first_request = True
        try:
            if request_started.receivers:
                request_started.send(self, _async_wrapper=self.ensure_sync)
            answer = self.preprocess_request()
            if answer is None:
                answer = self.dispatch_request()
        except Exception as e:
            answer = self.handle_user_exception(e)
        return self.finalize_request(answer)

    def finalize_request(self, rv: Any, from_error_handler: bool = False) -> Response:
        """Flask's, its `request_finished` sent only to receivers."""
        response = self.make_response(rv)
        try:
            response = self.process_response(response)
            if request_finished.receivers:
                request_finished.send(self, _async_wrapper=self.ensure_sync, response=response)
        except Exception:
            if not from_error_handler:
                raise
            self.logger.exception(
                "Request finalizing failed with an error while handling an error")
        return response

    def do_teardown_appcontext(self, exc: BaseException | None = _UNSET) -> None:  # type: ignore
        """Flask's, its `appcontext_tearing_down` sent only to receivers."""
        if exc is _UNSET:
            exc = sys.exc_info()[1]
        for func in reversed(self.teardown_appcontext_funcs):
            self.ensure_sync(func)(exc)
        if appcontext_tearing_down.receivers:
            appcontext_tearing_down.send(self, _async_wrapper=self.ensure_sync, exc=exc)

    def preprocess_request(self) -> Any:
        request = request_ctx._get_current_object().request
        hooks = self.hooks(request)
        for func in hooks.values:
            func(request.endpoint, request.view_args)
        for func in hooks.before:
            answer = func()
            if answer is not None:
                return answer
        return None

    def process_response(self, response: Response) -> Response:
        context = request_ctx._get_current_object()
        for func in context._after_request_functions:  # after_this_request's
            response = self.ensure_sync(func)(response)
        for func in self.hooks(context.request).after:
            response = func(response)
        session = context._session
        if session is not NoSession.NULL and \
                not self.session_interface.is_null_session(session):
            self.session_interface.save_session(self, session, response)
        return response

    def do_teardown_request(self, exc: BaseException | None = _UNSET) -> None:  # type: ignore
        if exc is _UNSET:
            exc = sys.exc_info()[1]
        for func in self.hooks(request_ctx._get_current_object().request).teardown:
            func(exc)
        if request_tearing_down.receivers:
            request_tearing_down.send(self, _async_wrapper=self.ensure_sync, exc=exc)

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
        asks (twice a body read). Its routing is `Routed`'s."""
        context = Routed(self, environ)
        context.request.max_content_length = self.config["MAX_CONTENT_LENGTH"]
        return context
