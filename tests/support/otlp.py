"""A minimal OTLP/HTTP trace receiver for tests: what an OpenTelemetry collector would get from
the API and the workers, decoded with OpenTelemetry's own protobuf classes."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict
    links: list[tuple[str, str]] = field(default_factory=list)


class Receiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                receiver._take(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value
                        for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append(Span(
                        resource.get("service.name", ""), span.name, span.trace_id.hex(),
                        span.span_id.hex(), span.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in span.attributes},
                        [(link.trace_id.hex(), link.span_id.hex()) for link in span.links]))

    def of_trace(self, trace_id: str) -> list[Span]:
        return [s for s in list(self.spans) if s.trace_id == trace_id]

    def stop(self) -> None:
        self.server.shutdown()


def _value(value) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None
