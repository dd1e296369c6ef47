"""`train.checkpoint_every: "auto"` end to end: the workflow chooses each
segment's checkpoint interval by Young-Daly from the run's measured checkpoint stall and
step time and the faults it has seen, records it, and the trainer checkpoints at it. Real
Temporal dev server, real workers (one SIGKILLed by an injected fault), real DeepSpeed."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowExecutionStatus

from ops.client import connect
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.runs import cli_status, run_to_end, tiny_spec
from workflows.interval import young_daly_steps

pytestmark = pytest.mark.e2e

# Three 60-step segments, each its own workflow run (the measurements cross continue-as-new
# in the carry). A prior MTBF of 10^6 s puts the interval at the segment's length until the
# run has seen a fault; the worker SIGKILLed after step 90 is one (its attempt is retried),
# and one fault replaces that prior (mtbf_prior_faults 1): the run's own MTBF - the tens of
# seconds its segments took - shortens the interval of the third segment. Measured on 2
# cores: 9 steps (C = 0.006 s, steps of 0.055 s, M = 20 s); on a loaded machine, with
# steps of 1 s, the lower bound (the interval in steps falls as steps slow down): either
# way well under the 60 of the prior.
AUTO = {"train.total_steps": 180, "train.segment_steps": 60, "train.segments_per_run": 1,
        "train.checkpoint_every": "auto", "train.checkpoint_every_min": 3,
        "sweep.enabled": False, "ops.mtbf_s": 1e6, "ops.mtbf_prior_faults": 1,
        "ops.heartbeat_timeout_s": 5.0, "faults": [{"kind": "kill_worker", "at_step": 90}]}
SEGMENTS = ([0, 60], [60, 120], [120, 180])


# Soak: the default suite covers its parts faster — the workflow's choice of each segment's
# interval and its shrinking after a fault (tests/workflows/test_training_run_stubs.py), the
# formula (tests/workflows/test_interval.py) and the trainer committing at the interval it is
# passed (tests/trainer/test_segment.py); a finished run's status after continue-as-new is
# read by the demo's test.
@pytest.mark.soak
def test_auto_checkpoint_interval_shrinks_after_an_observed_fault_and_commits_follow_it(
        temporal_server, fleet_factory, tmp_path, capsys):
    spec = tiny_spec("e2e-auto-ckpt", str(tmp_path / "store"), str(tmp_path / "fast"), **AUTO)
    fleet = fleet_factory(restart=True)
    result = asyncio.run(run_to_end(temporal_server.address, spec))
    assert result["status"] == "completed" and result["workflow_runs"] == 3
    assert fleet.restarts == {"trainer": 1}  # the injected fault really happened
    # one workflow run per segment: two continued as new, the last completed; and
    # `mainspring run status` reports the finished run through the workflow's query
    assert asyncio.run(run_statuses(temporal_server.address, spec.run_id)) == sorted(
        [WorkflowExecutionStatus.CONTINUED_AS_NEW] * 2 + [WorkflowExecutionStatus.COMPLETED])
    status = cli_status(capsys, spec.run_id, temporal_server.address)
    assert status["workflow_status"] == "COMPLETED" and status["stage"] == "completed"
    assert status["step"] == spec.train.total_steps

    events = read_events(spec.storage.durable, spec.run_id)
    chosen = [e["payload"] for e in events if e["kind"] == "checkpoint_interval"]
    assert [c["segment"] for c in chosen] == list(SEGMENTS)
    assert [c["faults"] for c in chosen] == [0, 0, 1]
    assert [c["mtbf_source"] for c in chosen] == ["prior", "prior", "observed"]
    first, calm, after = (c["steps"] for c in chosen)
    # nothing measured: the lower bound; measured, with the prior: the segment's length
    assert (first, calm) == (3, 60) and chosen[1]["steps_at_prior"] == 60
    # after the fault: the run's own MTBF (the wall time of its segments so far) shortens
    # it below what the prior gives, by the formula on the inputs the event records
    p = chosen[2]
    assert p["mtbf_s"] == pytest.approx(p["train_wall_s"], rel=1e-3) and p["mtbf_s"] < 600
    # (the event's inputs are rounded: the nearest step may differ by one)
    assert abs(after - young_daly_steps(p["checkpoint_cost_s"], p["mtbf_s"], p["step_time_s"],
                                        lo=3, hi=60)) <= 1
    assert 3 <= after < p["steps_at_prior"] == 60, chosen
    # the stalls of the first segment's 21 checkpoints (0, 3, ..., 60) and of the retried
    # second segment's one (120: it resumed from 60)
    assert p["checkpoints_measured"] == 22 and p["checkpoint_cost_s"] > 0

    # each segment committed at the multiples of its interval, and at its end
    committed = CheckpointStore(spec.storage.durable, spec.run_id).list_committed()
    expected = {0}
    for (lo, hi), every in zip(SEGMENTS, (first, calm, after)):
        expected |= {s for s in range(lo + 1, hi + 1) if s % every == 0} | {hi}
    assert committed == sorted(expected)


async def run_statuses(address: str, run_id: str) -> list[WorkflowExecutionStatus]:
    """The statuses of every workflow run of the workflow id `run_id`, sorted."""
    client = await connect(address)
    return sorted([r.status async for r in client.list_workflows(f"WorkflowId = '{run_id}'")])
