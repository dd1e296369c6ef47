"""The scrub_checkpoints activity as ops/worker.py registers it on the data queue, run by a
real worker on the real Temporal dev server against a real file:// store: a flipped byte is
found, recorded and uncommitted, and the result says so."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.contracts import DATA_QUEUE, SCRUB_CHECKPOINTS, ScrubInput, ScrubResult
from ops.worker import build_workers
from spec import preset
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.storage.ckpt_helpers import payload, write_files
from tests.storage.test_scrub import OPTIM, flip_byte


@workflow.defn(name="ScrubOnce")
class ScrubOnce:
    @workflow.run
    async def run(self, spec: dict) -> ScrubResult:
        return await workflow.execute_activity(
            SCRUB_CHECKPOINTS, ScrubInput(spec), task_queue=DATA_QUEUE, result_type=ScrubResult,
            start_to_close_timeout=timedelta(seconds=60))


def test_the_data_worker_scrubs_a_run_and_uncommits_a_corrupt_checkpoint(temporal_server,
                                                                          tmp_path):
    spec = preset("demo", run_id=f"scrub-{uuid.uuid4().hex[:6]}",
                  **{"storage.durable": str(tmp_path / "store"),
                     "storage.fast": str(tmp_path / "fast")})
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    for step in (20, 40, 60):
        store.commit(step, write_files(tmp_path / f"s{step}", payload(step)))
    expected, actual = flip_byte(store, 40)

    async def go() -> dict:
        client = await Client.connect(temporal_server.address)
        queue = f"scrub-test-{uuid.uuid4().hex[:6]}"
        workers = build_workers(client, {"data"})
        async with Worker(client, task_queue=queue, workflows=[ScrubOnce],
                          workflow_runner=UnsandboxedWorkflowRunner()):
            for w in workers:
                await w.__aenter__()
            try:
                return await client.execute_workflow(
                    "ScrubOnce", spec.to_dict(), id=f"scrub-once-{uuid.uuid4().hex[:6]}",
                    task_queue=queue, result_type=ScrubResult)
            finally:
                for w in reversed(workers):
                    await w.__aexit__(None, None, None)

    result = asyncio.run(asyncio.wait_for(go(), 90))

    assert result.corrupt == [40] and result.uncommitted == [40]
    assert 20 in result.verified and 60 in result.verified
    assert store.list_committed() == [20, 60]
    [event] = read_events(spec.storage.durable, spec.run_id, kinds=("checkpoint_corrupt",))
    assert event["payload"] == {"file": OPTIM, "expected": expected, "actual": actual}
    assert event["writer"].startswith("scrub-")
