"""Observability set-up: structlog JSON logs with trace ids, OTel spans to a local JSONL file.

Every process (worker, CLI, trainer child) calls `configure(service, spans_dir)` once.
Spans always go to `<spans_dir>/<service>-<pid>.jsonl` for offline review; an OTLP
endpoint is added when configured and its exporter package is installed. Both exporters,
and every log line, are scrubbed of secrets first (common/redact.py). Trainer children
join the supervisor's trace through the W3C `TRACEPARENT` environment variable.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

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
              replay_safe: bool = False) -> TracerProvider:
    """Logs + tracing for this process. `replay_safe` for processes that run workflows."""
    global _configured
    configure_logging()
    resource = Resource.create({"service.name": f"mainspring-{service}"})
    if replay_safe:
        from temporalio.contrib.opentelemetry import create_tracer_provider

        provider = create_tracer_provider(resource=resource)
    else:
        provider = TracerProvider(resource=resource)
    spans_dir = spans_dir or os.environ.get("MAINSPRING_SPANS_DIR", ".mainspring/spans")
    provider.add_span_processor(BatchSpanProcessor(RedactingSpanExporter(
        JsonlSpanExporter(os.path.join(spans_dir, f"{service}-{os.getpid()}.jsonl")))))
    endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            structlog.get_logger(__name__).warning(
                "otlp_exporter_missing", endpoint=endpoint,
                fix="pip install opentelemetry-exporter-otlp")
        else:
            provider.add_span_processor(BatchSpanProcessor(
                RedactingSpanExporter(OTLPSpanExporter(endpoint=endpoint))))
    if not _configured:
        trace.set_tracer_provider(provider)
        _configured = True
    return provider


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
