"""The API's answers (app/application.py Answer): a Location werkzeug would leave unchanged
is not given to it again; any other still is, and every header keeps its place."""
from __future__ import annotations

import pytest
from flask import Response
from werkzeug.test import create_environ

from app.application import Answer


def _headers(cls, location: str, status: int = 202, **more) -> list[tuple[str, str]]:
    response = cls("{}", status=status, mimetype="application/json")
    response.headers["Location"] = location
    for key, value in more.items():
        response.headers[key.replace("_", "-")] = value
    environ = create_environ("/v1/jobs", "http://api.example/")
    return list(response.get_wsgi_headers(environ).items()), list(response.headers.items())


@pytest.mark.parametrize("location", [
    "/v1/jobs/3f1c2a9e-0d4b-4c8e-9a57-1b2c3d4e5f60",
    "/v1/jobs/a%20b", "/v1/jobs/\u00e9t\u00e9", "/v1/jobs/a b", "//elsewhere/x",
    "/v1/jobs/x?wait=1", "/v1/jobs/x#top", "http://API.example:080/v1/jobs/x", "v1/jobs",
])
@pytest.mark.parametrize("status", [201, 202, 204, 304])
def test_the_headers_are_werkzeugs(location, status):
    assert _headers(Answer, location, status, X_Request_ID="r1") == \
        _headers(Response, location, status, X_Request_ID="r1")


def test_two_locations_are_werkzeugs():
    def made(cls):
        response = cls("{}", status=202)
        response.headers.add("location", "/a b")
        response.headers.add("X-Other", "1")
        response.headers.add("Location", "/v1/jobs/x")
        return list(response.get_wsgi_headers(create_environ()).items())

    assert made(Answer) == made(Response)


def test_an_absolute_location_is_werkzeugs():
    class Absolute(Answer):
        autocorrect_location_header = True

    class Plain(Response):
        autocorrect_location_header = True

    assert _headers(Absolute, "/v1/jobs/x") == _headers(Plain, "/v1/jobs/x")


# get_wsgi_response: an answer werkzeug would give back unchanged leaves as the answer holds it,
# any other through `get_wsgi_headers`; both exactly as the general path (werkzeug's
# get_wsgi_response over Answer's get_wsgi_headers, which the tests above hold to werkzeug's own)
# gives them.
LOCATIONS = [None, "/v1/jobs/3f1c2a9e-0d4b-4c8e-9a57-1b2c3d4e5f60", "/v1/jobs/a b", "//elsewhere",
             "/v1/jobs/\u00e9t\u00e9", ("location", "/v1/jobs/x"), ("LOCATION", "/v1/jobs/x"),
             ["/v1/jobs/x", "/v1/jobs/y"]]
MORE = {"plain": [], "request id": [("X-Request-ID", "r1"), ("Preference-Applied", "wait=5")],
        "content-location": [("Content-Location", "/v1/jobs/\u00e9")],
        "own length": [("content-length", "2")], "twice the length": [("Content-Length", "9")],
        "retry-after": [("Retry-After", "1"), ("X-Other", "a")]}


def _answered(general, status, location, more, method="GET", streamed=False):
    """(app_iter, status, headers) of an Answer; `general`: by werkzeug's get_wsgi_response."""
    body = iter([b"{}"]) if streamed else b'{"a": 1}\n'
    response = Answer(body, status=status, mimetype="application/json")
    if isinstance(location, str):
        response.headers.add("Location", location)
    elif isinstance(location, tuple):
        response.headers.add(*location)
    elif isinstance(location, list):
        for each in location:
            response.headers.add("Location", each)
    for key, value in more:
        response.headers.add(key, value)
    environ = create_environ("/v1/jobs", "http://api.example/", method=method)
    app_iter, status_line, headers = Response.get_wsgi_response(response, environ) \
        if general else response.get_wsgi_response(environ)
    return list(app_iter), status_line, headers


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("more", MORE)
@pytest.mark.parametrize("location", LOCATIONS, ids=str)
@pytest.mark.parametrize("status", [200, 201, 202, 204, 304, 404, 429, 503])
def test_the_wsgi_answer_is_werkzeugs(status, location, more, method):
    assert _answered(False, status, location, MORE[more], method) == \
        _answered(True, status, location, MORE[more], method)


@pytest.mark.parametrize("status", [200, 201])
def test_a_streamed_answer_is_werkzeugs(status):
    assert _answered(False, status, "/v1/jobs/x", [], streamed=True) == \
        _answered(True, status, "/v1/jobs/x", [], streamed=True)


def test_an_api_answer_leaves_without_its_headers_copied(monkeypatch):
    # A job's answer (Content-Length with its body, a Location of the API's own) is not copied
    # into new Headers by werkzeug's get_wsgi_headers (~25 calls) nor walked again: its own
    # headers leave as they are.
    def copied(self, environ):
        raise AssertionError("the headers were copied")

    monkeypatch.setattr(Response, "get_wsgi_headers", copied)
    monkeypatch.setattr(Answer, "get_wsgi_headers", copied)
    more = MORE["request id"]
    app_iter, status, headers = _answered(False, 201, LOCATIONS[1], more)
    assert status == "201 CREATED" and app_iter == [b'{"a": 1}\n']
    assert headers == [("Content-Type", "application/json"), ("Content-Length", "9"),
                       ("Location", LOCATIONS[1]), *more]
