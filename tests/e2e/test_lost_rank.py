"""A lost rank (issue 14): one rank of a world-size-2 segment is SIGKILLed mid-segment;
the launcher stops the other, the supervisor records a `rank_lost` fault naming the rank,
and restarts the segment in place (issue 16: the same attempt, the same worker, its warm
standby) from the last commit. Real Temporal dev server, real workers, real DeepSpeed
children on CPU/gloo."""

from __future__ import annotations

import time

import pytest

from tests.e2e.runs import (
    assert_recovered_from,
    assert_restarted_in_place,
    chaos_for,
    first_fault,
    newest_commit_at_or_before,
    run_in_background,
    strike,
    tiny_spec,
)
from tests.e2e.test_hung_rank import HUNG, MID_SEGMENT

pytestmark = pytest.mark.e2e


def test_a_sigkilled_rank_of_two_is_restarted_in_place_from_the_last_commit_with_no_commit_lost(  # noqa: E501
        temporal_server, fleet_factory, tmp_path):
    t0 = time.monotonic()
    spec = tiny_spec("e2e-lost-rank", str(tmp_path / "store"), str(tmp_path / "fast"), **HUNG)
    chaos = chaos_for(fleet_factory(), spec)
    runner, box = run_in_background(temporal_server.address, spec, 300)
    killed = strike(chaos, spec, "kill_rank", *MID_SEGMENT)
    assert killed["rank"] == 1, killed
    fault = first_fault(spec, "rank_lost")
    committed_at_fault = chaos.durable.list_committed()
    p = fault["payload"]
    resume_from = newest_commit_at_or_before(spec, p["last_step"])
    runner.join(300)
    result = box["result"]
    assert result["status"] == "completed"

    assert (p["kind"], p["rank"], p["injected"]) == ("rank_lost", 1, False), p
    # the evidence: torchrun stopping the others, or rank 0's own error (gloo's connection
    # reset by the dead peer) when it wrote error.json first
    assert p["evidence"] and p["log_tail"]
    assert fault["ts"] - killed["ts"] < 10.0, p  # the launcher's stop, not a timeout
    events = assert_recovered_from(spec, fault, resume_from, committed_at_fault)
    recovered = assert_restarted_in_place(spec, events, fault)
    assert recovered["lost_steps"] == p["last_step"] - resume_from
    print(f"\nlost-rank e2e: {time.monotonic() - t0:.1f}s; detected "
          f"{fault['ts'] - killed['ts']:.1f}s after the kill")
