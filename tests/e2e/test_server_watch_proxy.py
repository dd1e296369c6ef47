"""A run whose workers reach Temporal through a gRPC proxy that serves no `grpc.health.v1`
(as some proxies and cloud endpoints do not; tests/activities/grpc_frontends.py): the
server watch asks the API itself instead, so the run records no `server_unavailable`
fault for a server that answered all along, and each segment's result is handed over at
once; with the health check's UNIMPLEMENTED counted as an outage, every segment's result
waited an hour for the server to "come back"."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.activities.grpc_frontends import Frontend
from tests.e2e.runs import assert_completed_five_stages, run_to_end, tiny_spec

# Soak: tests/activities/test_server_watch_frontends.py makes the same claims against the
# same kind of frontend (the real dev server behind a gRPC proxy without grpc.health.v1):
# the watch probes with a real RPC, records no outage and holds no segment result; an
# upstream that is really gone is still an outage.
pytestmark = [pytest.mark.e2e, pytest.mark.soak]


@pytest.fixture
def proxy(temporal_server):
    frontend = Frontend.proxy(temporal_server.address, health=False)
    yield frontend
    frontend.stop()


def test_a_run_behind_a_frontend_without_health_checks_records_no_outage_and_waits_for_none(
        proxy, fleet_factory, tmp_path):
    spec = tiny_spec("e2e-no-health", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **{"train.total_steps": 40, "sweep.enabled": False})
    fleet_factory(address=proxy.address)
    began = time.monotonic()
    result = asyncio.run(run_to_end(proxy.address, spec, timeout_s=420))
    events = assert_completed_five_stages(result, spec)
    assert [e["payload"] for e in events if e["kind"] == "fault"] == []
    # the train stage ended when its segment did, not after a hold
    finished = next(e for e in events if e["kind"] == "segment_finished")
    train_done = next(e for e in events if e["kind"] == "stage_finished"
                      and e["payload"]["stage"] == "train")
    assert train_done["ts"] - finished["ts"] < 30, (finished, train_done)
    assert time.monotonic() - began < 420
    logs = " ".join(p.read_text() for p in (tmp_path / "logs").glob("*"))
    assert "server_watch_health_unsupported" in logs
