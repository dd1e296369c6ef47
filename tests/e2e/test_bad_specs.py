"""Bad specs and reused run ids end the workflow at once, instead of leaving it Running
forever or letting a second spec write into another run's record.

Each run is started with the Temporal Python client, without the CLI's validation, so the
workflow itself gets the bad input. Only an orchestrator worker runs: everything here is
refused before any data or trainer activity, so nothing trains and the file stays fast.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import uuid

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

from activities.contracts import ORCHESTRATOR_QUEUE, WORKFLOW_TYPE
from common.procs import WorkerFleet
from ops.client import connect
from tests.e2e.runs import tiny_spec

pytestmark = pytest.mark.e2e

# Seconds a refused run may take once the worker is polling (each is one or two workflow
# tasks); on the old code these runs stayed Running forever.
REFUSED_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def orchestrator(temporal_server, tmp_path_factory):
    """One orchestrator worker for the module's refused runs: none of them leaves
    anything running (each test's run ids are its own), and each worker takes seconds
    to start and stop."""
    fleet = WorkerFleet(temporal_server.address, roles=("orchestrator",),
                        log_dir=str(tmp_path_factory.mktemp("bad-specs") / "logs"),
                        restart=False).start()
    yield fleet
    fleet.stop()


async def _failure(client, raw: dict, carry: dict | None = None) -> tuple[Exception, float]:
    """Start TrainingRun with `raw` (unvalidated) and wait for it to fail: (cause, seconds)."""
    args = [raw] if carry is None else [raw, carry]
    handle = await client.start_workflow(WORKFLOW_TYPE, args=args, id=f"bad-{uuid.uuid4().hex}",
                                         task_queue=ORCHESTRATOR_QUEUE)
    t0 = time.monotonic()
    with pytest.raises(WorkflowFailureError) as info:
        await asyncio.wait_for(handle.result(), 90)
    assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED
    return info.value.cause, time.monotonic() - t0


def _listing(root: str) -> list[tuple[str, int]]:
    return sorted((os.path.relpath(os.path.join(d, n), root), os.path.getsize(os.path.join(d, n)))
                  for d, _, names in os.walk(root) for n in names)


def test_absurd_numbers_and_bad_run_ids_fail_the_run_at_once_naming_the_field(
        temporal_server, orchestrator, tmp_path):
    good = tiny_spec("e2e-badspec", str(tmp_path / "store"), str(tmp_path / "fast"),
                     prepared=False).to_dict()

    def bad(**changes) -> dict:
        raw = {**good, "ops": dict(good["ops"]), "sweep": dict(good["sweep"]),
               "train": dict(good["train"])}
        for dotted, value in changes.items():
            section, _, name = dotted.rpartition(".")
            (raw[section] if section else raw)[name] = value
        return raw

    async def scenario():
        client = await connect(temporal_server.address)
        await _failure(client, bad(**{"ops.segment_budget_s": -1.0}))  # the worker is up now
        return await asyncio.gather(
            _failure(client, bad(**{"ops.segment_budget_s": 1e20})),
            _failure(client, bad(**{"ops.segment_budget_s": math.inf})),
            _failure(client, bad(run_id="e2e-badspec\n")),
            _failure(client, bad(**{"sweep.space": {
                "warmup_steps": {"low": 1, "high": 50, "log": False}}})),
            _failure(client, ["not", "an", "object"]),
            # more nodes than any cluster: refused, never left waiting for nodes
            _failure(client, bad(**{"train.nodes": 100_000})))

    results = asyncio.run(scenario())
    fields = ["ops.segment_budget_s", "ops.segment_budget_s", "run_id",
              "sweep.space.warmup_steps.high", "spec",  # spec: the input is not an object
              "train.nodes"]
    for (cause, took), field in zip(results, fields, strict=True):
        assert cause.type == "BadConfig" and cause.message.startswith(f"{field}:"), cause
        assert took < REFUSED_WITHIN_S, (field, took)
    assert not os.path.exists(tmp_path / "store")  # refused before anything was written


def test_a_bug_in_workflow_code_fails_the_run_instead_of_retrying_its_task(
        temporal_server, orchestrator, tmp_path):
    # A carry (continue-as-new state) whose best LR warmup is infinite: int(inf) raises
    # OverflowError in workflows/policy.py:with_params — a bug-like exception, not a
    # Temporal failure, which used to retry the workflow task forever.
    spec = tiny_spec("e2e-bug", str(tmp_path / "store"), str(tmp_path / "fast"),
                     prepared=False).to_dict()
    carry = {"stages_done": ["prepare_data", "warmup_sweep"], "dataset_uri": "memory://none",
             "best_params": {"warmup_steps": math.inf}}

    async def scenario():
        return await _failure(await connect(temporal_server.address), spec, carry)

    cause, seconds = asyncio.run(scenario())
    assert cause.type == "OverflowError", cause
    assert seconds < 60


def test_a_run_id_another_spec_owns_fails_the_run_and_touches_nothing(
        temporal_server, orchestrator, tmp_path):
    from storage.runs import claim_run

    spec = tiny_spec("e2e-reused", str(tmp_path / "store"), str(tmp_path / "fast"),
                     prepared=False)
    run_dir = tmp_path / "store" / "runs" / spec.run_id
    # an earlier run of this id, with another spec, left a claim and a checkpoint
    claim_run(spec.storage.durable, spec.run_id, "0123456789abcdef", {"run_id": spec.run_id})
    ckpt = run_dir / "checkpoints" / "step-000000010"
    ckpt.mkdir(parents=True)
    (ckpt / "MANIFEST.json").write_text('{"step": 10}')
    before = _listing(str(run_dir))

    async def scenario():
        return await _failure(await connect(temporal_server.address), spec.to_dict())

    cause, seconds = asyncio.run(scenario())
    assert cause.type == "BadConfig" and cause.message.startswith("run_id: run e2e-reused "), cause
    assert "with spec 0123456789abcdef; this spec is " + spec.spec_hash() in cause.message
    assert "start it again with the same spec" in cause.message
    assert "pick a new run_id" in cause.message
    assert _listing(str(run_dir)) == before  # no event, no checkpoint, no skip range
    assert seconds < 60
