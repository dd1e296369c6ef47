"""Observability set-up: structlog JSON logs with trace ids, OTel spans to a local JSONL file
and, when an endpoint is set, to an OpenTelemetry collector over OTLP/HTTP.

A process that traces calls `configure(service, spans_dir, otlp_endpoint)` once. Spans
always go to `<spans_dir>/<service>-<pid>.jsonl` for offline review. They also go over
OTLP/HTTP (protobuf) when the process is given an endpoint — a process of one run passes
its spec's `ops.otlp_endpoint` (`mainspring run start` does) — or has the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT` set, which is how a
worker (shared by many runs) is pointed at one; the exporter reads `OTEL_EXPORTER_OTLP_HEADERS` (a collector's auth) from
the environment, never from the spec. Both exporters, and every log line, are scrubbed of
secrets first (common/redact.py). Trainer children join the supervisor's trace through
the W3C `TRACEPARENT` environment variable.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import structlog
from opentelemetry import context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from common.redact import redact, redact_value

_configured = False


class JsonlSpanExporter(SpanExporter):
    """One JSON object per finished span, appended to a local file."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a") as f:
            for span in spans:
                f.write(span.to_json(indent=None) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class RedactingSpanExporter(SpanExporter):
    """Wraps an exporter so no span leaves this process with a secret in it (issue 11 item
    7): Temporal's spans record exceptions — a trainer's log tail, a storage error — and
    the span file is kept for offline review like the event log."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.inner.export([scrub_span(s) for s in spans])

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def scrub_span(span: ReadableSpan) -> ReadableSpan:
    """A copy of a finished span with its name, attributes, events and status scrubbed."""
    description = span.status.description
    status = Status(span.status.status_code, redact(description)) if description else span.status
    return ReadableSpan(
        name=redact(span.name), context=span.context, parent=span.parent,
        resource=span.resource, attributes=_scrub_attributes(span.attributes),
        events=[Event(e.name, _scrub_attributes(e.attributes), e.timestamp) for e in span.events],
        links=span.links, kind=span.kind, status=status, start_time=span.start_time,
        end_time=span.end_time, instrumentation_scope=span.instrumentation_scope)


def _scrub_attributes(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return redact_value(dict(attributes)) if attributes else None


def _redact_log(_, __, event_dict: dict) -> dict:
    """structlog processor: a log line is scrubbed like an event (after exceptions are
    formatted, so a traceback's messages are scrubbed too)."""
    return redact_value(event_dict)


def _add_trace_ids(_, __, event_dict: dict) -> dict:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict["trace_id"] = format(ctx.trace_id, "032x")
        event_dict["span_id"] = format(ctx.span_id, "016x")
    return event_dict


def configure_logging(level: str = "") -> None:
    level = (level or os.environ.get("MAINSPRING_LOG_LEVEL", "info")).upper()
    logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), _add_trace_ids,
                    structlog.processors.format_exc_info, _redact_log,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, 20)),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def configure(service: str, spans_dir: str = "", otlp_endpoint: str = "",
              replay_safe: bool = False, log_level: str = "") -> TracerProvider:
    """Logs + tracing for this process. `otlp_endpoint` (a run's `ops.otlp_endpoint`) wins
    over the OTEL_EXPORTER_OTLP_* environment; `replay_safe` for processes that run
    workflows."""
    global _configured
    configure_logging(log_level)
    resource = Resource.create({"service.name": f"mainspring-{service}"})
    if replay_safe:
        from temporalio.contrib.opentelemetry import create_tracer_provider

        provider = create_tracer_provider(resource=resource)
    else:
        provider = TracerProvider(resource=resource)
    spans_dir = spans_dir or os.environ.get("MAINSPRING_SPANS_DIR", ".mainspring/spans")
    provider.add_span_processor(BatchSpanProcessor(RedactingSpanExporter(
        JsonlSpanExporter(os.path.join(spans_dir, f"{service}-{os.getpid()}.jsonl")))))
    otlp = otlp_exporter(otlp_endpoint)
    if otlp is not None:
        provider.add_span_processor(BatchSpanProcessor(RedactingSpanExporter(otlp)))
    if not _configured:
        trace.set_tracer_provider(provider)
        _configured = True
    return provider


def otlp_exporter(endpoint: str = "") -> SpanExporter | None:
    """The OTLP/HTTP span exporter for `endpoint`, else for the OTEL_EXPORTER_OTLP_* variables;
    None when neither names a collector (the SDK would otherwise assume localhost:4318).
    Imported here: only a process that exports pays for requests and protobuf."""
    if not (endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # without an endpoint argument the exporter reads the variables as the OTel spec says
    return OTLPSpanExporter(endpoint=traces_url(endpoint) if endpoint else None)


def traces_url(endpoint: str) -> str:
    """Pure: `host:port` or `http(s)://host:port[/path]` (common/urls.py:check_endpoint) as
    the URL spans are POSTed to: http:// when no scheme is given; a bare address gets the
    OTLP/HTTP traces path `/v1/traces` (as OTEL_EXPORTER_OTLP_ENDPOINT does), a path is
    kept as written."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    return url.rstrip("/") + "/v1/traces" if urlsplit(url).path in ("", "/") else url


def child_trace_env() -> dict[str, str]:
    """TRACEPARENT for a child process, so its spans join the current trace."""
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return {"TRACEPARENT": carrier["traceparent"]} if "traceparent" in carrier else {}


def attach_parent_from_env() -> None:
    """In a child: make TRACEPARENT (if any) the current context."""
    parent = os.environ.get("TRACEPARENT")
    if parent:
        context.attach(TraceContextTextMapPropagator().extract({"traceparent": parent}))


def flush() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()
