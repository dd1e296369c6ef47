"""A real `mainspring worker` process, configured through the environment, serves both
Prometheus endpoints: mainspring's own and the Temporal SDK's (polling the session's
Temporal server). The training series themselves are checked in-process in
tests/common/test_metrics.py; this checks the worker start-up wiring."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from common.metrics import PORT_ENV, TEMPORAL_PORT_ENV
from common.procs import WorkerFleet
from ops.services import free_port

pytestmark = pytest.mark.e2e


def scrape_until(port: int, wanted: str, timeout_s: float = 90.0) -> str:
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            if wanted in text:
                return text
        except (urllib.error.URLError, ConnectionError):
            pass  # the worker is still importing
        time.sleep(0.5)
    raise AssertionError(f"{wanted!r} not served on :{port} within {timeout_s}s; got {text[:500]!r}")


def test_worker_serves_its_metrics_and_temporal_sdk_metrics_on_the_configured_ports(
        temporal_server, tmp_path):
    ours, sdk = free_port(), free_port()
    fleet = WorkerFleet(temporal_server.address, roles=("data",), log_dir=str(tmp_path),
                        restart=False, env={PORT_ENV: str(ours), TEMPORAL_PORT_ENV: str(sdk)})
    fleet.start()
    try:
        # Training series appear with the first step a trainer reports (in-process test);
        # until then the endpoint serves prometheus_client's process metrics.
        scrape_until(ours, "process_resident_memory_bytes")
        # The client and the worker use the Runtime set before connecting: the worker's
        # pollers report with its task queue, and the client's requests are counted.
        text = scrape_until(sdk, 'task_queue="mainspring-data"')
        assert 'temporal_request_total{operation="GetSystemInfo"' in text
    finally:
        fleet.stop()
