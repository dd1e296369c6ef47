"""A lost rank (issue 14): one rank of a world-size-2 segment is SIGKILLed mid-segment;
torchrun stops the other, the supervisor records a `rank_lost` fault naming the rank, and
the retry resumes from the last commit. Real Temporal dev server, real workers, real
torchrun children on CPU/gloo."""

from __future__ import annotations

import time

import pytest

from ops.chaos import Chaos
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.runs import tiny_spec, wait_for
from tests.e2e.test_hung_rank import (
    HUNG,
    newest_commit_at_or_before,
    run_in_background,
    strike_mid_segment,
)

pytestmark = pytest.mark.e2e


def test_a_sigkilled_rank_of_two_is_retried_from_the_last_commit_with_no_commit_lost(
        temporal_server, fleet_factory, tmp_path):
    t0 = time.monotonic()
    spec = tiny_spec("e2e-lost-rank", str(tmp_path / "store"), str(tmp_path / "fast"), **HUNG)
    fleet = fleet_factory()
    durable = CheckpointStore(spec.storage.durable, spec.run_id)
    chaos = Chaos(worker_pid=lambda: fleet.procs["trainer"].pid, durable=durable,
                  fast_root=str(tmp_path / "fast" / spec.run_id))
    runner, box = run_in_background(temporal_server.address, spec)
    killed = strike_mid_segment(chaos, spec, "kill_rank")
    assert killed["rank"] == 1, killed
    fault = wait_for(lambda: next(iter(read_events(spec.storage.durable, spec.run_id,
                                                    kinds=("fault",))), None), 120,
                     "the lost rank's fault event")
    committed_at_fault = durable.list_committed()
    p = fault["payload"]
    resume_from = newest_commit_at_or_before(spec, p["last_step"])
    runner.join(300)
    result = box["result"]
    assert result["status"] == "completed"

    assert (p["kind"], p["rank"], p["injected"]) == ("rank_lost", 1, False), p
    # the evidence: torchrun stopping the others, or rank 0's own error (gloo's connection
    # reset by the dead peer) when it wrote error.json first
    assert p["evidence"] and p["log_tail"]
    assert fault["ts"] - killed["ts"] < 30.0, p  # torchrun's stop, not a timeout
    events = read_events(spec.storage.durable, spec.run_id)
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert [e["payload"]["fault_event_id"] for e in recovered] == [fault["event_id"]]
    assert recovered[0]["payload"]["resumed_step"] == resume_from
    assert recovered[0]["payload"]["lost_steps"] == p["last_step"] - resume_from
    # no committed checkpoint was lost, and every one the run should have is there
    final = durable.list_committed()
    assert set(committed_at_fault) <= set(final)
    assert final == list(range(0, spec.train.total_steps + 1, spec.train.checkpoint_every))
    faults = [e["payload"]["kind"] for e in events if e["kind"] == "fault"]
    assert faults == ["rank_lost"], faults
    print(f"\nlost-rank e2e: {time.monotonic() - t0:.1f}s; detected "
          f"{fault['ts'] - killed['ts']:.1f}s after the kill")
