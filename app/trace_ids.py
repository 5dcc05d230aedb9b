"""Each request's trace id: with OpenTelemetry on, its trace's id (a caller's `traceparent`
decides it; tasks/tracing.py); otherwise the client's `X-Request-ID` when it is a sane one,
else a new one of the same shape. On every log line of the request and echoed in the
response."""
from __future__ import annotations

import re

from flask import Flask, g, request

from config.job_ids import uuid4_hex
from tasks import tracing
from tasks.logs import trace_id_var

_TRACE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def init_app(app: Flask) -> None:
    @app.before_request
    def _trace_id() -> None:
        given = request.headers.get("X-Request-ID", "")
        trace_id = tracing.current_trace_id() or (
            given if _TRACE_ID.match(given) else uuid4_hex())
        values = g._get_current_object()  # one look-up of the request's `g`, not three
        values.trace_id = trace_id
        values.trace_token = trace_id_var.set(trace_id)  # reset when the request ends

    @app.teardown_request
    def _end_trace(_exc: BaseException | None) -> None:
        token = g.pop("trace_token", None)
        if token is not None:
            trace_id_var.reset(token)

    @app.after_request
    def _echo_trace_id(response):
        trace_id = g.get("trace_id")
        if trace_id is not None:
            response.headers["X-Request-ID"] = trace_id
        return response
