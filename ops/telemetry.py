"""Observability set-up: structlog JSON logs with trace ids, OTel spans to a local JSONL file.

Every process (worker, CLI, trainer child) calls `configure(service, spans_dir)` once.
Spans always go to `<spans_dir>/<service>-<pid>.jsonl` for offline review; an OTLP
endpoint is added when configured and its exporter package is installed. Trainer children
join the supervisor's trace through the W3C `TRACEPARENT` environment variable.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

import structlog
from opentelemetry import context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

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
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
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
    provider.add_span_processor(BatchSpanProcessor(
        JsonlSpanExporter(os.path.join(spans_dir, f"{service}-{os.getpid()}.jsonl"))))
    endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            structlog.get_logger(__name__).warning(
                "otlp_exporter_missing", endpoint=endpoint,
                fix="pip install opentelemetry-exporter-otlp")
        else:
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
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
