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
