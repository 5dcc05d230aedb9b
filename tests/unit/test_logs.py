from __future__ import annotations

import json
import logging

from tasks.logs import JsonFormatter, TraceIdFilter, trace


def test_json_log_lines_carry_the_trace_id():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "job %s started", ("j1",), None)
    with trace("abc-123"):
        TraceIdFilter().filter(record)
    entry = json.loads(JsonFormatter().format(record))
    assert entry["trace_id"] == "abc-123" and entry["message"] == "job j1 started"
    outside = logging.LogRecord("x", logging.INFO, __file__, 1, "m", (), None)
    TraceIdFilter().filter(outside)
    assert outside.trace_id == "-"
