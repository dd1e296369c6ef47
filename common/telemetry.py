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

import contextlib
import contextvars
import logging
import os
import random
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import structlog
from opentelemetry import context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
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
    """Wraps an exporter so no span leaves this process with a secret in it: Temporal's
    spans record exceptions — a trainer's log tail, a storage error — and the span file is
    kept for offline review like the event log."""

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


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as the one JSON line the durable store keeps (storage/spans.py):
    hex ids, integer nanosecond times, plain attributes, events and links."""
    ctx, res = span.context, dict(span.resource.attributes) if span.resource else {}
    return {
        "trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
        "name": span.name, "start_ns": span.start_time, "end_ns": span.end_time,
        "status": span.status.status_code.name.lower(),
        "status_message": span.status.description or "",
        "service": res.get("service.name", ""), "pid": res.get("process.pid", os.getpid()),
        "parent_hint": res.get("mainspring.parent_span_id"),
        "attributes": _plain(span.attributes),
        "events": [{"name": e.name, "ts_ns": e.timestamp, "attributes": _plain(e.attributes)}
                   for e in span.events],
        "links": [{"trace_id": format(link.context.trace_id, "032x"),
                   "span_id": format(link.context.span_id, "016x")} for link in span.links],
    }


def _plain(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attributes or {}).items()}


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


class _StderrLogger:
    """structlog's PrintLogger, writing to whatever `sys.stderr` is when each line is logged:
    a logger cached while stderr was a harness's (pytest's capture, a daemon's redirect)
    never writes to that stream after it is closed."""

    _lock = threading.Lock()

    def msg(self, message: str) -> None:
        with self._lock:
            print(message, file=sys.stderr, flush=True)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg


def _stderr_logger(*_args: Any) -> _StderrLogger:
    return _StderrLogger()


def configure_logging(level: str = "") -> None:
    level = (level or os.environ.get("MAINSPRING_LOG_LEVEL", "info")).upper()
    logging.basicConfig(stream=sys.stderr, level=level, format="%(message)s")
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"), _add_trace_ids,
                    structlog.processors.format_exc_info, _redact_log,
                    structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, 20)),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=True,
    )


SPAN_FLUSH_MS = int(os.environ.get("MAINSPRING_SPAN_FLUSH_MS", "2000"))  # batch export delay


def configure(service: str, spans_dir: str = "", otlp_endpoint: str = "",
              replay_safe: bool = False, log_level: str = "",
              exporters: Sequence[SpanExporter] = ()) -> TracerProvider:
    """Logs + tracing for this process. `otlp_endpoint` (a run's `ops.otlp_endpoint`) wins
    over the OTEL_EXPORTER_OTLP_* environment; `replay_safe` for processes that run
    workflows (their span ids come from the workflow's deterministic random, or are preset:
    `preset_span_id`); `exporters` get every span too (storage/spans.py's durable one). A
    child process started with TRACEPARENT records that parent's span id on its resource
    (`parent_hint`), so its spans can be placed when the parent was killed mid-span."""
    global _configured
    configure_logging(log_level)
    attrs: dict[str, Any] = {"service.name": f"mainspring-{service}", "process.pid": os.getpid()}
    hint = _traceparent_span_id(os.environ.get("TRACEPARENT", ""))
    if hint:
        attrs["mainspring.parent_span_id"] = hint
    resource = Resource.create(attrs)
    if replay_safe:
        from opentelemetry.sdk.trace import TracerProvider as SdkProvider
        from temporalio.contrib.opentelemetry._tracer_provider import ReplaySafeTracerProvider

        generator = _preset_id_generator()(OwnRandomIdGenerator())
        provider = ReplaySafeTracerProvider(SdkProvider(resource=resource, id_generator=generator),
                                            generator)
    else:
        provider = TracerProvider(resource=resource, id_generator=OwnRandomIdGenerator())
    spans_dir = spans_dir or os.environ.get("MAINSPRING_SPANS_DIR", ".mainspring/spans")
    outs: list[SpanExporter] = [JsonlSpanExporter(
        os.path.join(spans_dir, f"{service}-{os.getpid()}.jsonl")), *exporters]
    otlp = otlp_exporter(otlp_endpoint)
    if otlp is not None:
        outs.append(otlp)
    for out in outs:
        _add_exporter(provider, out)
    if not _configured:
        trace.set_tracer_provider(provider)
        _configured = True
    return provider


def _add_exporter(provider: Any, exporter: SpanExporter) -> None:
    provider.add_span_processor(BatchSpanProcessor(RedactingSpanExporter(exporter),
                                                   schedule_delay_millis=SPAN_FLUSH_MS))
    _EXPORTERS.append(exporter)


_EXPORTERS: list[SpanExporter] = []


class OwnRandomIdGenerator(RandomIdGenerator):
    """Span and trace ids from a random generator of their own, seeded from the OS. The
    SDK's default draws from the module-level `random`, which a trainer resets whenever it
    restores a checkpoint (trainer/state.py restores the RNG states for an exact resume):
    the spans after a restore or rollback then reused the ids of spans before it, and the
    store kept only one of each (measured in the goodput soak: 64 steps' spans lost)."""

    def __init__(self) -> None:
        self._random = random.Random(int.from_bytes(os.urandom(16), "big"))

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1


def add_exporter(exporter: SpanExporter) -> None:
    """Send this process's spans to `exporter` too, from now on (after `configure`)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "add_span_processor"):
        _add_exporter(provider, exporter)


def bind_run(durable_url: str, run_id: str, trace_id: str = "") -> None:
    """Spans of `trace_id` (default: the current span's trace) belong to run `run_id`,
    stored under `durable_url` (storage/spans.py routes them there)."""
    trace_id = trace_id or current_trace_id()
    for exporter in _EXPORTERS:
        if hasattr(exporter, "bind"):
            exporter.bind(trace_id, durable_url, run_id)


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def _traceparent_span_id(traceparent: str) -> str:
    parts = traceparent.split("-")
    return parts[2] if len(parts) >= 4 and len(parts[2]) == 16 else ""


_PRESET: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "preset_span_id", default=None)


def _preset_id_generator() -> type:
    """Temporal's deterministic id generator, with one addition: a span id preset by
    `preset_span_id` (a workflow span begun in one workflow run and ended in a later one
    after continue-as-new keeps the id its children already point at)."""
    from temporalio.contrib.opentelemetry._id_generator import TemporalIdGenerator

    class PresetIdGenerator(TemporalIdGenerator):
        def generate_span_id(self) -> int:
            preset = _PRESET.get()
            return preset[0] if preset is not None else super().generate_span_id()

        def generate_trace_id(self) -> int:  # a root span's (one with a parent inherits it)
            preset = _PRESET.get()
            return preset[1] if preset is not None else super().generate_trace_id()

    return PresetIdGenerator


@contextlib.contextmanager
def preset_span_id(span_id: int, trace_id: int) -> Iterator[None]:
    """A span started in this context gets `span_id` (and, if it is a root, `trace_id`);
    replay-safe providers only (`configure(replay_safe=True)`)."""
    token = _PRESET.set((span_id, trace_id))
    try:
        yield
    finally:
        _PRESET.reset(token)


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


def flush(timeout_millis: int = 10_000) -> None:
    """Export every finished span now (on a fault, on SIGTERM, before exit)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush(timeout_millis)


def tracer() -> trace.Tracer:
    return trace.get_tracer("mainspring")
