"""common/telemetry.py: spans reach an OTLP/HTTP collector when an endpoint is set (a run's
`ops.otlp_endpoint` or the OTEL_EXPORTER_OTLP_* environment), and the local span file
still gets every span. The collector is a real HTTP server on loopback that decodes what
the SDK's exporter sends, as a collector would (tests/common/otlp.py)."""

from __future__ import annotations

import json

import pytest

from common import telemetry
from tests.common.otlp import Collector

GH = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


@pytest.fixture
def provider_of(monkeypatch, tmp_path):
    """configure() without replacing this test process's global provider; shut down after."""
    monkeypatch.setattr(telemetry, "_configured", True)
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    made = []

    def make(**kw):
        made.append(telemetry.configure("unit", spans_dir=str(tmp_path / "spans"), **kw))
        return made[-1]
    yield make
    for p in made:
        p.shutdown()


def test_a_span_reaches_the_run_s_otlp_endpoint_and_the_local_span_file(
        collector, provider_of, tmp_path):
    provider = provider_of(otlp_endpoint=collector.address)  # host:port, as a spec gives it
    with provider.get_tracer("t").start_as_current_span("segment 0-60") as span:
        span.set_attribute("mainspring.run_id", "r1")
    assert provider.force_flush(10_000)
    (path, ctype, _), = collector.requests
    assert (path, ctype) == ("/v1/traces", "application/x-protobuf")
    (service, got), = collector.spans()
    assert service == "mainspring-unit" and got.name == "segment 0-60"
    assert got.span_id == span.get_span_context().span_id.to_bytes(8, "big")
    assert [(a.key, a.value.string_value) for a in got.attributes] == [("mainspring.run_id", "r1")]
    (spans_file,) = (tmp_path / "spans").glob("unit-*.jsonl")  # the local copy is still written
    assert [json.loads(line)["name"] for line in spans_file.read_text().splitlines()] == \
        ["segment 0-60"]


def test_spans_sent_over_otlp_are_scrubbed_of_secrets(collector, provider_of):
    provider = provider_of(otlp_endpoint=f"http://{collector.address}")
    with provider.get_tracer("t").start_as_current_span(f"GET token={GH}") as span:
        span.set_attribute("url", f"https://u:hunter2xx@h/x?token={GH}")
    assert provider.force_flush(10_000)
    (_, got), = collector.spans()
    sent = got.SerializeToString()
    assert GH.encode() not in sent and b"hunter2xx" not in sent
    assert got.name == "GET token=***"


def test_the_standard_otlp_environment_variable_points_a_worker_at_a_collector(
        collector, provider_of, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://{collector.address}")
    provider = provider_of()  # a worker: no spec, only its environment
    provider.get_tracer("t").start_span("RunWorkflow:TrainingRun").end()
    assert provider.force_flush(10_000)
    assert [(p, s.name) for (p, _, _), (_, s) in zip(collector.requests, collector.spans())] \
        == [("/v1/traces", "RunWorkflow:TrainingRun")]


def test_without_an_endpoint_nothing_is_exported_over_otlp(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert telemetry.otlp_exporter("") is None  # the SDK would assume localhost:4318


@pytest.mark.parametrize("endpoint, url", [
    ("collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318", "http://collector:4318/v1/traces"),
    ("https://otel.example.com/", "https://otel.example.com/v1/traces"),
    ("https://gw.example.com/otlp/v1/traces", "https://gw.example.com/otlp/v1/traces"),
    ("[::1]:4318", "http://[::1]:4318/v1/traces")])
def test_an_endpoint_becomes_the_otlp_http_traces_url(endpoint, url):
    assert telemetry.traces_url(endpoint) == url


def test_span_ids_do_not_repeat_when_the_trainer_restores_the_global_random_state():
    # A resume restores Python's `random` state (trainer/state.py); the SDK's default id
    # generator draws from it, so the spans after a restore reused earlier ids and the
    # store kept one of each (seen in a goodput soak: 64 steps' spans lost).
    import random

    gen = telemetry.OwnRandomIdGenerator()
    random.seed(7)
    first = [gen.generate_span_id() for _ in range(5)]
    random.seed(7)
    again = [gen.generate_span_id() for _ in range(5)]
    assert len(set(first + again)) == 10
    assert telemetry.OwnRandomIdGenerator().generate_trace_id() != gen.generate_trace_id()


def test_spans_the_store_refused_during_an_outage_are_written_with_the_next_export(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from storage.spans import DurableSpanExporter, read_spans

    store = tmp_path / "store"
    exporter = DurableSpanExporter("t", run=(str(store), "r1"))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    store.write_text("not a directory: the store is unavailable")
    with tracer.start_as_current_span("steps 1-25"):
        pass
    assert exporter.unsent  # kept, not dropped
    store.unlink()
    with tracer.start_as_current_span("steps 26-50"):
        pass
    assert not exporter.unsent
    assert sorted(s["name"] for s in read_spans(str(store), "r1")) == ["steps 1-25", "steps 26-50"]


def test_a_logger_cached_while_stderr_was_a_closed_capture_writes_to_the_stderr_of_now(
        monkeypatch):
    import io

    import structlog
    first, now = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", first)
    telemetry.configure_logging("info")
    log = structlog.get_logger("unit")
    log.info("cached_while_captured")
    first.close()  # what pytest does to a test's capture when the test ends
    monkeypatch.setattr("sys.stderr", now)
    log.warning("after_the_capture_closed", n=1)
    assert json.loads(now.getvalue().splitlines()[-1])["event"] == "after_the_capture_closed"
