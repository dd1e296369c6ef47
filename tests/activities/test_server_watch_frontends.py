"""The server watch against frontends other than a plain dev server (activities/
server_watch.py): the real Temporal dev server behind a gRPC proxy that serves no
`grpc.health.v1` (some proxies and cloud endpoints do not) or answers slowly, and a gRPC
server that serves nothing. A health check such a frontend cannot answer, or answers
within the probe's timeout, is no outage: no `server_unavailable` fault, and a finished
segment's result is not held back waiting for a probe that cannot succeed. An upstream
that is really gone, or a frontend that stays silent past the timeout, still is one."""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs
from temporalio.service import ConnectConfig

from activities.server_watch import HealthProbe, ServerWatch
from ops.services import free_port
from storage.events import EventLog, read_events
from tests.activities.grpc_frontends import Frontend

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

EVERY_S = 0.2  # probes this far apart: a test sees several in a second


@pytest.fixture
def frontends():
    started: list[Frontend] = []

    def start(frontend: Frontend) -> Frontend:
        started.append(frontend)
        return frontend
    yield start
    for frontend in started:
        frontend.stop()


def watch_on(address: str, tmp_path, **probe_kw) -> tuple[ServerWatch, HealthProbe, str]:
    store = str(tmp_path / "store")
    progress = tmp_path / "progress.jsonl"
    progress.write_text("")
    probe = HealthProbe(ConnectConfig(target_host=address), **probe_kw)
    watch = ServerWatch(probe, EventLog(store, "r1", "server-watch", attempt=1),
                        id_base="0-40/abc/1", segment="0-40", address=address,
                        progress_file=str(progress), every_s=EVERY_S)
    return watch, probe, store


def run_then_hold(watch: ServerWatch, probe: HealthProbe, watch_s: float,
                  max_hold_s: float = 30.0) -> float:
    """Watch for `watch_s`, then end the segment as `watching` does; the hold's seconds."""
    watch.start()
    try:
        time.sleep(watch_s)
        began = time.monotonic()
        watch.hold_until_reachable(lambda: None, lambda s: time.sleep(s) or False, max_hold_s)
        return time.monotonic() - began
    finally:
        watch.stop()
        probe.close()


def faults(store: str) -> list[dict]:
    return [e["payload"] for e in read_events(store, "r1", kinds=("fault", "recovered"))]


def watch_until_a_fault(watch, probe, store, within_s: float = 20.0) -> list[dict]:
    """Run the watch until it records a fault (or `within_s` passes); the faults recorded."""
    watch.start()
    try:
        deadline = time.monotonic() + within_s
        while not faults(store) and time.monotonic() < deadline:
            time.sleep(EVERY_S)
    finally:
        watch.stop()
        probe.close()
    return faults(store)


def test_a_frontend_without_the_health_service_is_probed_with_a_real_rpc_and_answers(
        temporal_server, frontends):
    proxy = frontends(Frontend.proxy(temporal_server.address, health=False))
    probe = HealthProbe(ConnectConfig(target_host=proxy.address))
    try:
        with capture_logs() as logs:
            assert [probe(), probe(), probe()] == ["", "", ""]
    finally:
        probe.close()
    # said once, not on every probe
    assert [e["event"] for e in logs].count("server_watch_health_unsupported") == 1, logs


def test_a_frontend_without_the_health_service_records_no_outage_and_holds_no_result(
        temporal_server, frontends, tmp_path):
    proxy = frontends(Frontend.proxy(temporal_server.address, health=False))
    watch, probe, store = watch_on(proxy.address, tmp_path)
    held = run_then_hold(watch, probe, watch_s=6 * EVERY_S)
    assert faults(store) == []
    assert held < 1.0, f"the result waited {held:.1f}s for a probe that cannot succeed"


def test_behind_such_a_frontend_an_upstream_that_is_gone_is_still_an_outage(
        frontends, tmp_path):
    proxy = frontends(Frontend.proxy(f"127.0.0.1:{free_port()}", health=False))  # nobody there
    watch, probe, store = watch_on(proxy.address, tmp_path)
    [fault] = watch_until_a_fault(watch, probe, store)
    assert fault["kind"] == "server_unavailable" and "UNAVAILABLE" in fault["evidence"].upper()


def test_a_slow_frontend_that_answers_within_the_probe_timeout_is_no_outage(
        temporal_server, frontends, tmp_path):
    proxy = frontends(Frontend.proxy(temporal_server.address, health=True, delay_s=4.0))
    watch, probe, store = watch_on(proxy.address, tmp_path)
    held = run_then_hold(watch, probe, watch_s=9.0)  # two slow answers
    assert faults(store) == []
    assert held < 6.0, held  # at most the probe in flight


def test_a_frontend_silent_past_the_probe_timeout_is_an_outage(
        temporal_server, frontends, tmp_path):
    proxy = frontends(Frontend.proxy(temporal_server.address, health=True, delay_s=30.0))
    watch, probe, store = watch_on(proxy.address, tmp_path, timeout_s=0.5)
    [fault] = watch_until_a_fault(watch, probe, store)
    assert fault["kind"] == "server_unavailable", fault


def test_a_frontend_that_serves_neither_health_nor_temporal_turns_the_watch_off_with_a_warning(
        frontends, tmp_path):
    bare = frontends(Frontend.bare())
    watch, probe, store = watch_on(bare.address, tmp_path)
    with capture_logs() as logs:
        held = run_then_hold(watch, probe, watch_s=6 * EVERY_S)
    assert faults(store) == []
    assert held < 1.0, held
    [off] = [e for e in logs if e["event"] == "server_watch_off"]
    assert off["log_level"] == "warning" and "UNIMPLEMENTED" in off["reason"].upper(), off
