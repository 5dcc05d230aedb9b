"""The API's Blueprint (app/openapi.py): flask-smorest's `alt_response` and `doc` document a
view without wrapping it, and the document they give is flask-smorest's own."""
from __future__ import annotations

import flask_smorest
from flask import Flask

from app.openapi import Blueprint


def _documented(blueprint_class: type[flask_smorest.Blueprint]) -> tuple[Flask, dict, object]:
    app = Flask(__name__)
    app.config.update(API_TITLE="t", API_VERSION="1", OPENAPI_VERSION="3.1.0")
    api = flask_smorest.Api(app)
    bp = blueprint_class("things", __name__)

    def view():
        """Read a thing."""
        return "ok"

    documented = bp.route("/thing")(
        bp.doc(summary="A thing", operationId="getThing")(
            bp.alt_response(409, description="taken")(
                bp.alt_response(404, description="none")(
                    bp.doc(security=[{"apiKey": []}])(view)))))
    api.register_blueprint(bp)
    return app, api.spec.to_dict()["paths"]["/thing"], documented


def test_documenting_decorators_leave_the_view_unwrapped():
    app, _doc, documented = _documented(Blueprint)
    assert documented.__name__ == "view" and not hasattr(documented, "__wrapped__")
    assert app.view_functions["things.view"] is documented  # what Flask calls each request
    assert app.test_client().get("/thing").data == b"ok"


def test_the_document_is_flask_smorests_own():
    _app, ours, _view = _documented(Blueprint)
    _app, theirs, _view = _documented(flask_smorest.Blueprint)
    assert ours == theirs
    assert set(ours["get"]["responses"]) >= {"404", "409"}
    assert ours["get"]["summary"] == "A thing" and ours["get"]["security"] == [{"apiKey": []}]
