"""A hung rank: one rank of a world-size-2 segment is SIGSTOPped mid-segment; the
supervisor's AUTO hang timeout — max(hang_floor_s, hang_step_factor x the p99 step time
measured in the segment) — fires, the fault is recorded, and the retry resumes from the last
commit — restarted in place by the same worker, from its warm standby (no Temporal retry,
no cold start). Real
Temporal dev server, real workers, real DeepSpeed children on CPU/gloo."""

from __future__ import annotations

import json
import pathlib
import time

import pytest

from activities.hang import checkpoint_io_s, hang_deadline
from storage import fast_tier
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
from tests.e2e.test_trace import fault_span_events

pytestmark = pytest.mark.e2e

# One 60-step segment at world size 2, with steps long enough (~0.2 s on 2 CPU cores) that a
# strike lands mid-segment. Only the floor is lowered from its 60 s, so that the default
# k = 10 x the p99 step time decides (2-6 s here, with the load of the machine) and the test
# stays short; no sweep, so the run is data -> train -> eval.
HUNG = {"train.procs_per_node": 2, "train.total_steps": 60, "train.segment_steps": 60,
        "train.segments_per_run": 1, "train.checkpoint_every": 10,
        "train.micro_batch_tokens": 4096, "sweep.enabled": False,
        "ops.hang_floor_s": 1.0, "ops.heartbeat_timeout_s": 8.0}
# strike here: the segment, its latest step (the eval: 40). From step 22 on: the step-10
# checkpoint's commit (the tiered writer's, a process of its own) is done by then, so there
# is a commit before the fault to resume from; at step 12 it could still be in flight
MID_SEGMENT = ((0, 60), (22, 32))


def attempt_step_times(spec, attempt: int, restart: int = 0) -> list[float]:
    """The step times one launch of the segment wrote (progress.jsonl, after its start
    line): attempt `attempt`'s, or its `restart`-th restart in place's."""
    root = pathlib.Path(fast_tier.run_dir(spec.storage.fast, spec.run_id), "segments")
    path = next(root.glob("*/progress.jsonl"))
    times, current = [], None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "start":
            current = (rec["attempt"], rec.get("restart", 0))
        elif rec["type"] == "step" and current == (attempt, restart):
            times.append(rec["step_time_s"])
    return times


def test_a_sigstopped_rank_of_two_is_detected_within_the_auto_timeout_plus_5s_and_restarted_in_place_from_the_last_commit(  # noqa: E501
        temporal_server, fleet_factory, tmp_path):
    t0 = time.monotonic()
    spec = tiny_spec("e2e-hung-rank", str(tmp_path / "store"), str(tmp_path / "fast"), **HUNG)
    assert spec.ops.hang_timeout_s == "auto"
    chaos = chaos_for(fleet_factory(), spec)
    runner, box = run_in_background(temporal_server.address, spec, 300)
    stopped = strike(chaos, spec, "hang", *MID_SEGMENT)
    assert stopped["rank"] == 1 and stopped["stopped"], stopped
    fault = first_fault(spec, "hang")
    committed_at_fault = chaos.durable.list_committed()
    p = fault["payload"]
    resume_from = newest_commit_at_or_before(spec, p["last_step"])
    runner.join(300)
    result = box["result"]
    assert result["status"] == "completed"

    # the AUTO timeout fired, and says what it was made of
    assert (p["timeout"], p["auto"]) == ("hang_timeout_s", True), p
    assert p["phase"] in ("step", "checkpoint"), p  # stopped after a checkpoint step or not
    assert p["rank"] == 1 and "rank 1 is stopped" in p["evidence"] and not p["injected"]
    # the launch's first step (its warm-up) left the window when its second was measured
    times = attempt_step_times(spec, p["attempt"], p.get("restart", 0))[1:]
    assert p["steps_measured"] == len(times) > 0 and p["p99_step_s"] == pytest.approx(
        max(times), abs=1e-4)  # fewer than 100 steps: the p99 is the slowest
    io = checkpoint_io_s(p["checkpoint_bytes"], spec.ops.checkpoint_mb_per_s) \
        if p["phase"] == "checkpoint" else 0.0
    assert p["timeout_s"] == pytest.approx(hang_deadline(
        times, spec.ops.hang_floor_s, spec.ops.hang_step_factor) + io, abs=1e-3)
    # ... within the timeout + 5 s of the stop
    assert fault["ts"] - stopped["ts"] <= p["timeout_s"] + 5.0, (fault["ts"] - stopped["ts"], p)
    assert p["waited_s"] > p["timeout_s"]

    events = assert_recovered_from(spec, fault, resume_from, committed_at_fault)
    assert_restarted_in_place(spec, events, fault)
    fault_span_events(spec, "hang")  # a span event where it was seen, in the store
    print(f"\nhung-rank e2e: {time.monotonic() - t0:.1f}s; timeout {p['timeout_s']}s "
          f"({p['timeout_how']}), detected {fault['ts'] - stopped['ts']:.1f}s after the stop")
