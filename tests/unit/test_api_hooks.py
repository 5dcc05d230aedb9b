"""The API's Flask (app/application.py) asks whether a hook or view is a coroutine function
once per function, not on every request."""
from __future__ import annotations

import inspect

import pytest

from app.application import KEPT, Api


@pytest.fixture
def looked_up(monkeypatch):
    """The functions Flask's own check was asked about, in order."""
    asked = []
    real = inspect.iscoroutinefunction

    def counting(func):
        asked.append(func)
        return real(func)

    import flask.app
    monkeypatch.setattr(flask.app, "iscoroutinefunction", counting)
    return asked


def test_each_hook_and_view_is_looked_up_once(looked_up):
    app = Api(__name__)
    seen = []
    app.before_request(lambda: seen.append("before") and None)
    app.after_request(lambda response: seen.append("after") or response)
    app.route("/x")(lambda: "ok")
    client = app.test_client()
    for _ in range(5):
        assert client.get("/x").data == b"ok"
    assert seen == ["before", "after"] * 5
    assert len(looked_up) == len(set(looked_up)) == 3  # once each, not five times


def test_functions_made_per_request_are_not_kept(looked_up):
    app = Api(__name__)
    for i in range(KEPT + 10):
        assert app.ensure_sync(lambda i=i: i)() == i
    assert len(app._plain) == KEPT
