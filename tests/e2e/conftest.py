"""Fixtures for end-to-end tests: worker fleets against the session's Temporal server."""

from __future__ import annotations

import pytest

from common.procs import WorkerFleet


@pytest.fixture
def fleet_factory(temporal_server, tmp_path):
    fleets: list[WorkerFleet] = []

    def make(restart: bool = False, env: dict | None = None) -> WorkerFleet:
        fleet = WorkerFleet(temporal_server.address, log_dir=str(tmp_path / "logs"),
                            restart=restart, env=env or {}).start()
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()
