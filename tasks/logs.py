"""Logging shared by the API and the workers: every line carries the trace id of the job (or
request) it is about, from a context variable; `log_format: json` (IQ_LOG_FORMAT) gives one
JSON object a line for log shippers."""
from __future__ import annotations

import contextvars
import json
import logging
from contextlib import contextmanager
from typing import Iterator

trace_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("trace_id", default="-")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [trace_id=%(trace_id)s] %(message)s"


class TraceIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "trace_id"):
            record.trace_id = trace_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname,
                 "logger": record.name, "trace_id": getattr(record, "trace_id", "-"),
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


@contextmanager
def trace(trace_id: str | None) -> Iterator[None]:
    token = trace_id_var.set(trace_id or "-")
    try:
        yield
    finally:
        trace_id_var.reset(token)


def configure_handler(handler: logging.Handler, log_format: str = "text") -> None:
    """The trace id filter and the format (settings.log_format: text or json)."""
    if not any(isinstance(f, TraceIdFilter) for f in handler.filters):
        handler.addFilter(TraceIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))


def configure_celery(log_format: str) -> None:
    """A worker's logging: Celery's own handlers, in the main process and in every pool
    child, get the trace id filter and the format. Call it from a worker's entry module."""
    from celery import signals

    def configure_handlers(logger: logging.Logger | None = None, **_kw: object) -> None:
        for handler in (logger.handlers if logger else []):
            configure_handler(handler, log_format)

    # weak=False: the receiver is this closure, which nothing else keeps alive.
    signals.after_setup_logger.connect(configure_handlers, weak=False)
    signals.after_setup_task_logger.connect(configure_handlers, weak=False)


def configure(level: str = "INFO", log_format: str = "text") -> None:
    """The API's logging: one stderr handler on the root logger, with trace ids."""
    root = logging.getLogger()
    if not any(isinstance(f, TraceIdFilter) for h in root.handlers for f in h.filters):
        handler = logging.StreamHandler()
        configure_handler(handler, log_format)
        root.addHandler(handler)
    root.setLevel(level)
