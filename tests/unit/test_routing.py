"""The API's request routing (app/application.py Routed): a request to a rule without
arguments is matched by werkzeug once and its answer kept; everything else is werkzeug's own
match each time. Held to werkzeug's own `MapAdapter.match` (through Flask's own
`RequestContext.match_request`) over seeded random requests: rule, arguments and error
(404, 405, redirects to the slashed path, a rule's redirect, websocket mismatches) alike,
each asked twice so that the second answer may come from what was kept."""
from __future__ import annotations

import random

import pytest

from flask.ctx import RequestContext
from werkzeug.test import EnvironBuilder

from app.application import KEPT_ROUTES, Api
from tests.support.calls import calls


def _view(**_args: object) -> str:
    return "ok"


def app_matching_hosts() -> Api:
    """An Api that routes by host too (werkzeug's host matching): the same path is two
    rules on two hosts."""
    app = Api("routing-hosts", host_matching=True, static_folder=None)
    app.add_url_rule("/v1/jobs", "submit", _view, methods=["POST"], host="api.example")
    app.add_url_rule("/v1/jobs", "local", _view, methods=["POST", "GET"], host="localhost")
    app.add_url_rule("/healthz", "healthz", _view, host="api.example:8080")
    return app


def app_with_rules() -> Api:
    """An Api with rules of every kind the router treats apart: the API's own shapes (a
    collection, an item with an argument, probes), a slashed path (a redirect from the bare
    one), defaults, a rule's own redirect, methods, converters, a websocket rule."""
    app = Api("routing")
    app.add_url_rule("/v1/jobs", "submit", _view, methods=["POST"])
    app.add_url_rule("/v1/jobs", "list", _view, methods=["GET"])
    app.add_url_rule("/v1/jobs/<job_id>", "job", _view, methods=["GET", "DELETE"])
    app.add_url_rule("/v1/jobs/<job_id>/retry", "retry", _view, methods=["POST"])
    app.add_url_rule("/healthz", "healthz", _view)
    app.add_url_rule("/metrics", "metrics", _view)
    app.add_url_rule("/openapi.json", "openapi", _view)
    app.add_url_rule("/docs/", "docs", _view)
    app.add_url_rule("/pages/", "pages", _view, defaults={"page": 1})
    app.add_url_rule("/pages/<int:page>", "pages", _view)
    app.add_url_rule("/old", "old", _view, redirect_to="/healthz")
    app.add_url_rule("/put-only", "put", _view, methods=["PUT"])
    app.add_url_rule("/files/<path:name>", "files", _view)
    app.add_url_rule("/ws", "ws", _view, websocket=True)
    app.add_url_rule("/strict", "strict", _view, strict_slashes=False)
    return app


PATHS = ["/v1/jobs", "/v1/jobs/", "/v1/jobs/abc", "/v1/jobs/abc/", "/v1/jobs/abc/retry",
         "/v1/jobs/a%2Fb", "/v1//jobs", "//v1/jobs", "///healthz", "/healthz", "/healthz/",
         "/HEALTHZ", "/metrics", "/openapi.json", "/docs", "/docs/", "/pages", "/pages/",
         "/pages/1", "/pages/2", "/pages/x", "/old", "/put-only", "/files/a/b", "/files/",
         "/ws", "/strict", "/strict/", "/", "", "/nothing", "/v1/jobs/\u00e9", "/v1/j\u00f6bs",
         "/%00", "/v1/jobs/" + "x" * 300]
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "BREW", "get"]
HOSTS = ["localhost", "api.example", "API.EXAMPLE:8080", "127.0.0.1:80", "h\u00e9"]
UPGRADES = [{}, {"Connection": "Upgrade", "Upgrade": "websocket"},
            {"Connection": "keep-alive, upgrade", "Upgrade": "WebSocket"}]


def environ(rng: random.Random) -> dict:
    path = rng.choice(PATHS)
    query = rng.choice(["", "x=1", "wait=2&a=b"])
    builder = EnvironBuilder(path=path, method=rng.choice(METHODS), query_string=query,
                             base_url=f"{rng.choice(['http', 'https'])}://"
                                      f"{rng.choice(HOSTS)}",
                             headers=rng.choice(UPGRADES))
    return builder.get_environ()


def matched(context: RequestContext, match) -> tuple:
    match(context)
    request = context.request
    error = request.routing_exception
    return (request.url_rule, request.view_args, type(error), getattr(error, "code", None),
            getattr(error, "new_url", None), sorted(getattr(error, "valid_methods", None) or ()))


@pytest.mark.parametrize("make", [app_with_rules, app_matching_hosts])
def test_random_requests_are_routed_as_werkzeug_routes_them(make):
    app = make()
    app._got_first_request = True  # as after the first request: the rules are settled
    rng = random.Random(4040)
    for _ in range(3000):
        env = environ(rng)
        expected = matched(RequestContext(app, dict(env)), RequestContext.match_request)
        for _again in range(2):
            context = app.request_context(dict(env))
            assert matched(context, type(context).match_request) == expected, env["PATH_INFO"]
    # Rules without arguments answered; none with arguments, no error kept.
    assert app._routes and all(not rule.arguments for rule in app._routes.values())
    assert {rule.rule for rule in app._routes.values()} >= \
        ({"/v1/jobs", "/healthz", "/docs/", "/strict"} if make is app_with_rules else
         {"/v1/jobs", "/healthz"})


def test_a_rule_without_arguments_is_matched_by_werkzeug_once():
    """The second POST /v1/jobs is answered from the kept match: werkzeug's matcher is not
    walked; a job's URL (a rule with an argument) is matched by werkzeug each time."""
    app = app_with_rules()
    client = app.test_client()
    assert client.post("/v1/jobs").status_code == 200  # the first request: rules settle
    assert client.post("/v1/jobs").status_code == 200  # its match kept
    answers = []
    again = calls(lambda: answers.append(client.post("/v1/jobs")), "werkzeug/routing/map.py",
                  "match")
    assert answers[0].status_code == 200 and again == 0
    assert calls(lambda: client.get("/v1/jobs/abc"), "werkzeug/routing/map.py", "match") == 1
    assert calls(lambda: client.get("/v1/jobs/abc"), "werkzeug/routing/map.py", "match") == 1
    # An error is werkzeug's each time too.
    assert calls(lambda: client.get("/nothing"), "werkzeug/routing/map.py", "match") == 1
    assert calls(lambda: client.get("/nothing"), "werkzeug/routing/map.py", "match") == 1
    assert client.get("/nothing").status_code == 404
    assert client.get("/put-only").status_code == 405


def test_nothing_is_kept_before_the_first_request_and_no_more_than_the_bound():
    """Rules may still be added until the first request (Flask's rule): nothing is kept
    before it. Past KEPT_ROUTES answers (a client varying leading slashes: werkzeug
    matches "///healthz" as "/healthz") werkzeug matches as before."""
    app = app_with_rules()
    with app.test_request_context("/healthz"):
        pass
    assert not app._routes
    app._got_first_request = True
    for slashes in range(1, KEPT_ROUTES + 50):
        env = EnvironBuilder(path="/healthz").get_environ()
        env["PATH_INFO"] = "/" * slashes + "healthz"
        context = app.request_context(env)
        context.match_request()
        assert context.request.url_rule.rule == "/healthz"
    assert len(app._routes) == KEPT_ROUTES
