"""OpenTelemetry traces across the API and the workers: off unless the standard OTEL_*
variables turn them on, e.g. `OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318` (OTLP over
HTTP) or `OTEL_TRACES_EXPORTER=console`. `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES` and
`OTEL_BSP_*` are honoured as usual.

One trace per job, its id the job's `trace_id`: the API's `POST /v1/jobs` span (Flask's
instrumentation, Redis's for the submit script: one call for submits grouped together, under
the first one's POST) and, in the pool child that ran it,
`iq.queue_wait` (submission to the start of its batch) and `iq.batch` (with the batch's size,
the model's version and the other jobs in it as links) over `iq.model` (the model call) and
`iq.result.write`. The context travels in the task message's headers (W3C `traceparent`).
Celery's own instrumentation is not used: jobs never pass through Celery's per-task tracer,
they run a batch at a time.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Iterable, MutableMapping

logger = logging.getLogger(__name__)

_provider: Any = None


def wanted() -> bool:
    """Whether the environment asks for traces."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters == "none":
        return False
    return bool(exporters) or bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                                   or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def active() -> bool:
    return _provider is not None


def setup(service: str) -> bool:
    """Install a tracer provider for this process when the environment asks for traces;
    returns whether it did. Call it in the process that makes the spans (a pool child, not
    the worker's parent: the exporter's thread does not survive a fork)."""
    global _provider
    if _provider is not None or not wanted():
        return _provider is not None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").lower().split(","):
        name = name.strip()
        if name == "otlp":
            if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf") != "http/protobuf":
                logger.warning("only OTLP over HTTP (http/protobuf) is installed; using it")
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name:
            logger.warning("OTEL_TRACES_EXPORTER %r is not supported here (otlp, console)", name)
    trace.set_tracer_provider(provider)
    _provider = provider
    logger.info("OpenTelemetry traces on for %s", service)
    return True


def shutdown() -> None:
    """Export what is buffered (a pool child is about to exit)."""
    if _provider is not None:
        _provider.shutdown()


def current_trace_id() -> str | None:
    """The current span's trace id as 32 hex digits, when there is one."""
    if not active():
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def inject(headers: MutableMapping[str, Any]) -> None:
    """The current context into a task message's headers (`traceparent`)."""
    if active():
        from opentelemetry import propagate

        propagate.inject(headers)


def batch_spans(model: str, jobs: Iterable[tuple[str, dict, float | None]], *, batch: dict,
                version: str, started_ns: int, model_ns: tuple[int, int], write_ns: tuple[int, int],
                ended_ns: int) -> None:
    """A finished batch's spans, in each job's own trace: (job id, its message headers, its
    submission time in seconds) per job; the times in nanoseconds since the epoch."""
    if not active():
        return
    from opentelemetry import propagate, trace

    tracer = trace.get_tracer("inference_queue.worker")
    jobs = list(jobs)
    contexts = [propagate.extract(headers) for _id, headers, _t in jobs]
    parents = [trace.get_current_span(c).get_span_context() for c in contexts]
    for i, ((job_id, _headers, submitted), context) in enumerate(zip(jobs, contexts)):
        attributes = {"iq.job.id": job_id, "iq.model": model, "iq.model.version": version}
        if submitted:
            wait = tracer.start_span("iq.queue_wait", context=context, attributes=attributes,
                                     start_time=int(submitted * 1e9))
            wait.end(end_time=started_ns)
        others = [trace.Link(p, {"iq.job.id": jobs[j][0]})
                  for j, p in enumerate(parents) if j != i and p.is_valid]
        span = tracer.start_span("iq.batch", context=context, links=others,
                                 start_time=started_ns, attributes={
                                     **attributes, "iq.batch.id": batch["id"],
                                     "iq.batch.jobs": batch["jobs"],
                                     "iq.batch.items": batch["items"]})
        inside = trace.set_span_in_context(span)
        tracer.start_span("iq.model", context=inside, attributes=attributes,
                          start_time=model_ns[0]).end(end_time=model_ns[1])
        tracer.start_span("iq.result.write", context=inside, attributes=attributes,
                          start_time=write_ns[0]).end(end_time=write_ns[1])
        span.end(end_time=ended_ns)
