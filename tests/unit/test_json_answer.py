"""A JSON answer (app/json_provider.py OrjsonProvider.answer, through app/responses.py answer)
is made at once, its headers given to it in one Headers (issue 40), and is the very answer
werkzeug's way makes (the response, then its status and headers set one by one): status,
headers in order, body, whatever its headers."""
from __future__ import annotations

import sys

import pytest
from werkzeug.test import create_environ

from app.application import Api, Answer
from app.json_provider import OrjsonProvider

BODIES = [{"id": "j", "status": "succeeded", "result": {"outputs": [[0.5, -1.0]]}},
          {"error": {"code": "not_found", "message": "no job 'x' \u00e9"}}, [], {1: "a"}]
HEADERS = {
    "none": None, "empty": {},
    "a job's": {"Location": "/v1/jobs/j", "Preference-Applied": "wait=5"},
    "retry": {"Retry-After": "5"}, "another": {"X-Other": "1", "location": "/a"},
    "its own type": {"content-type": "text/plain"}, "its own length": {"Content-Length": "1"},
    "not text": {"Retry-After": 5}, "a list": {"Link": ["a", "b"]},
}


@pytest.fixture(scope="module")
def provider():
    app = Api(__name__)
    app.json = OrjsonProvider(app)
    yield app.json  # (the provider holds its app weakly: kept alive here)
    del app


def _made(response: Answer) -> tuple:
    assert type(response) is Answer
    return (response.status, list(response.headers.items()), response.response,
            response.direct_passthrough, response.get_data(),
            response.get_wsgi_response(create_environ())[1:])


@pytest.mark.parametrize("headers", HEADERS)
@pytest.mark.parametrize("status", [200, 201, 202, 429, 503])
@pytest.mark.parametrize("body", range(len(BODIES)))
def test_an_answer_is_the_one_werkzeugs_way_makes(provider, body, status, headers):
    given = HEADERS[headers]
    assert _made(provider.answer(BODIES[body], status, given)) == \
        _made(provider._answer_general(BODIES[body], status, given))


def test_a_jobs_answer_sets_no_header_one_by_one(provider):
    # Its four headers are given to it at once: no Headers.set (each validating the value
    # again and looking the name up among those already there).
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("datastructures/headers.py"):
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        response = provider.answer(BODIES[0], 201, HEADERS["a job's"])
    finally:
        sys.setprofile(None)
    assert response.status_code == 201
    assert "set" not in calls and "update" not in calls and "__setitem__" not in calls
