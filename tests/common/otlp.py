"""A tiny OTLP/HTTP collector for tests: a real HTTP server on loopback (stdlib http.server,
in a thread) that decodes what the SDK's exporter POSTs to /v1/traces, as a collector would."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Collector:
    """POST /v1/traces on 127.0.0.1: keeps (path, content type, decoded request)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, ExportTraceServiceRequest]] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((self.path, self.headers.get("Content-Type", ""),
                                 ExportTraceServiceRequest.FromString(body)))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[tuple[str, object]]:
        """(service.name, span) of every span received."""
        out = []
        for _, _, req in self.requests:
            for rs in req.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes
                               if a.key == "service.name")
                out.extend((service, s) for ss in rs.scope_spans for s in ss.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
