"""Responses serialised with orjson. A job of 32 embeddings is 12,288 floats: the standard
library takes ~10 ms to write them, orjson a few hundred microseconds, and the API's one
process writes every result it serves.

Request bodies are still parsed by the standard library (app/jobs.py), whose errors and
edge cases (big integers, lone surrogates) the validation layer is built around.
"""
from __future__ import annotations

from typing import Any, Mapping


import orjson
from flask import Response
from flask.json.provider import JSONProvider
from werkzeug.datastructures import Headers
from werkzeug.utils import get_content_type

# Keys as the code wrote them (no sorting); non-string keys as strings, like the stdlib.
_OPTIONS = orjson.OPT_NON_STR_KEYS
# The Content-Type werkzeug gives a response made with mimetype="application/json".
_JSON = get_content_type("application/json", "utf-8")
# Headers `answer` leaves to `response`, which sets them itself (any spelling).
_OWN = ("content-type", "content-length")
_PLAIN = frozenset({"Location", "Preference-Applied", "Retry-After"})  # none of those two


class OrjsonProvider(JSONProvider):
    def dumps(self, obj: Any, **kwargs: Any) -> str:
        return orjson.dumps(obj, option=_OPTIONS).decode()

    def loads(self, s: str | bytes, **kwargs: Any) -> Any:
        return orjson.loads(s)

    def response(self, *args: Any, **kwargs: Any) -> Response:
        body = orjson.dumps(self._prepare_response_obj(args, kwargs),
                            option=_OPTIONS | orjson.OPT_APPEND_NEWLINE)
        return self._app.response_class(body, mimetype="application/json")

    def answer(self, obj: Any, status: int, headers: Mapping[str, str] | None) -> Response:
        """`response(obj)` with `status`, then `headers` set, as one answer made at once: its
        headers (Content-Type, Content-Length, then `headers` in their order) given to it in
        one Headers, not set one by one as werkzeug makes a response, sets its status and its
        body, then status and headers set again (~30 calls a job's answer, issue 40). The
        same answer (tests/unit/test_json_answer.py compares them); headers that are not text,
        or that name the two it sets, go the general way."""
        for key, value in (headers or {}).items():
            if type(value) is not str or (key not in _PLAIN and key.lower() in _OWN):
                return self._answer_general(obj, status, headers)
        body = orjson.dumps(obj, option=_OPTIONS | orjson.OPT_APPEND_NEWLINE)
        own = [("Content-Type", _JSON), ("Content-Length", str(len(body)))]
        if headers:
            own += headers.items()
        response = self._app.response_class(None, status=status, headers=Headers(own))
        response.response = [body]  # set_data's but for Content-Length, already there
        return response

    def _answer_general(self, obj: Any, status: int,
                        headers: Mapping[str, Any] | None) -> Response:
        """`answer` as werkzeug makes it: the response, then its status and headers set."""
        response = self.response(obj)
        response.status_code = status
        response.headers.update(headers or {})
        return response
