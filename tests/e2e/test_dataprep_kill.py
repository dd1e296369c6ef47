"""SIGKILL the data worker mid-stage: Temporal retries prepare_data on a new worker, which
redoes only the unfinished work units and commits the same dataset as an uninterrupted run.

Soak: the retry waits for prepare_data's heartbeat timeout (>= 60 s, workflows/policy.py).
`tests/dataprep/test_resume.py` covers the same resume logic in-process, fast.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal

import pytest

from common.procs import WorkerFleet
from dataprep.pipeline import PROVENANCE_STATS, prepare_dataset
from ops.client import connect, start_run
from storage.dataset import load_manifest
from storage.events import read_events
from tests.e2e.runs import tiny_spec, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.soak]


def comparable(man) -> dict:
    return {**man.__dict__, "stats": {k: v for k, v in man.stats.items()
                                      if k not in PROVENANCE_STATS}}


def markers(store: str, prefix: str) -> list[str]:
    return sorted(glob.glob(os.path.join(store, "datasets", "*", "work", f"{prefix}-*.done")))


def test_sigkilled_data_worker_is_retried_and_redoes_only_unfinished_units(temporal_server,
                                                                           tmp_path):
    store = str(tmp_path / "store")
    # All 168 top-level stdlib modules (~4.7 MB) in ~200 KB units: ~24 units per job kind.
    spec = tiny_spec("e2e-dataprep-kill", store, str(tmp_path / "fast"),
                     **{"data.max_documents": 0, "data.unit_bytes": 200_000, "data.workers": 2})
    fleet = WorkerFleet(temporal_server.address, roles=("orchestrator", "data"),
                        log_dir=str(tmp_path / "logs"), restart=True).start()
    try:
        async def scenario():
            client = await connect(temporal_server.address)
            handle = await start_run(client, spec)
            # Kill once a few units are committed, before the manifest (the commit point).
            wait_for(lambda: len(markers(store, "clean") + markers(store, "tokens")) >= 3
                     and not glob.glob(os.path.join(store, "datasets", "*", "MANIFEST.json")),
                     120, "some committed work units", every_s=0.02)
            victim = fleet.procs["data"]
            fleet.kill("data", signal.SIGKILL)
            victim.wait(10)
            await asyncio.sleep(0.5)  # its pool children die with it (parent-death signal)
            left = (len(markers(store, "clean")), len(markers(store, "tokens")))
            ready = await asyncio.to_thread(
                wait_for, lambda: [e for e in read_events(store, spec.run_id)
                                   if e["kind"] == "dataset_ready"], 240, "dataset_ready")
            await handle.terminate("only the data stage is under test")
            return left, ready[0]

        (clean_left, tokens_left), ready = asyncio.run(scenario())
    finally:
        fleet.stop()

    resume = ready["payload"]["resume"]
    units = resume["units"]
    assert ready["attempt"] == 2 and not ready["payload"]["cache_hit"]
    assert fleet.restarts.get("data") == 1
    # Exactly the units committed before the kill were reused; the rest were redone.
    assert (resume["clean_reused"], resume["tokenize_reused"]) == (clean_left, tokens_left)
    assert 0 < clean_left + tokens_left < 2 * units
    started = sorted(e["attempt"] for e in read_events(store, spec.run_id)
                     if e["kind"] == "dataprep_started")
    assert started == [1, 2]

    resumed = load_manifest(ready["payload"]["uri"])
    _, clean, _ = prepare_dataset(spec.data, str(tmp_path / "uninterrupted"), seed=spec.seed)
    assert clean.stats["resume"] == {"units": units, "clean_reused": 0, "tokenize_reused": 0}
    assert comparable(resumed) == comparable(clean)
