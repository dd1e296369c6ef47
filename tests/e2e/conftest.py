"""Fixtures for end-to-end tests: worker fleets against the session's Temporal server."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.service import RPCError, RPCStatusCode

from common.procs import WorkerFleet
from ops.client import connect
from tests.e2e import runs


async def terminate_running(address: str, reason: str,
                            keep: frozenset[str] = frozenset()) -> list[str]:
    """Terminate every workflow still running on the server but those `keep` names;
    returns their ids. A test that fails midway leaves its run going, and the next test's
    workers would pick it up (its activities, its spans, its load)."""
    client = await connect(address)
    ended = []
    async for wf in client.list_workflows('ExecutionStatus="Running"'):
        if wf.id in keep:
            continue
        try:
            await client.get_workflow_handle(wf.id, run_id=wf.run_id).terminate(reason=reason)
            ended.append(wf.id)
        except RPCError as err:  # it ended between the listing and now
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
    return ended


@pytest.fixture(scope="session", autouse=True)
def prepared_datasets(tmp_path_factory):
    """One data prep per session for the tiny runs' data config (tests/e2e/runs.py)."""
    runs.PREPARED_ROOT = str(tmp_path_factory.mktemp("prepared-datasets"))
    yield
    runs.PREPARED_ROOT = None


@pytest.fixture
def fleet_factory(temporal_server, tmp_path, request):
    fleets: list[WorkerFleet] = []

    def make(restart: bool = False, env: dict | None = None,
             roles: tuple[str, ...] = ("orchestrator", "data", "trainer"),
             log_dir: str = "logs", args: tuple[str, ...] = (),
             wrap: tuple[str, ...] = (), address: str = "") -> WorkerFleet:
        fleet = WorkerFleet(address or temporal_server.address, roles=roles,
                            log_dir=str(tmp_path / log_dir), restart=restart,
                            env=env or {}, args=args, wrap=wrap).start()
        fleets.append(fleet)
        return fleet

    yield make
    asyncio.run(terminate_running(temporal_server.address, f"end of {request.node.name}"))
    for fleet in fleets:
        fleet.stop()
