"""The faulted run under tensor and under pipeline parallelism, through the real workflow: a
rank SIGKILLed mid-segment is restarted in place from the last commit (the layout's every
rank file resumed: TP shards, PP layer files), then a rank SIGSTOPped is found hung and
restarted the same way, then a window of corrupted batches is a sustained spike rolled back
past, and the run ends with no commit lost. Real Temporal dev
server, real workers, DeepSpeed children on gloo, two ranks: TP 2 (one replica of two
shards) and PP 2 (one pipeline of two stages).

What each fault does under data parallelism is test_rank_faults.py's
and test_spike_escalation.py's (default suite); these are their layouts' versions, about a
minute each: soak."""

from __future__ import annotations

import pytest

from storage.events import read_events
from tests.e2e.runs import (
    HUNG,
    MID_SEGMENT,
    chaos_for,
    first_fault,
    newest_commit_at_or_before,
    run_in_background,
    strike,
    tiny_spec,
)

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

LAYOUTS = {"tp2": {"tp": 2, "pp": 1, "zero": 0}, "pp2": {"tp": 1, "pp": 2, "zero": 0}}
HANG_AT = (38, 46)  # after the kill's window (22-32) and its recovery from step 20 or 30
CORRUPT_AT = 52  # after the hang's recovery


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_killed_rank_and_a_spike_are_recovered_under_the_layout(
        temporal_server, fleet_factory, tmp_path, layout):
    spec = tiny_spec(f"e2e-faults-{layout}", str(tmp_path / "store"), str(tmp_path / "fast"),
                     **{**HUNG, "train.layout": LAYOUTS[layout], "train.grad_accum": 2,
                        "train.eval_every": 0,
                        "faults": [{"kind": "corrupt_batches", "at_step": CORRUPT_AT,
                                    "steps": 4}]})
    chaos = chaos_for(fleet_factory(), spec)
    runner, box = run_in_background(temporal_server.address, spec, 400)
    struck, committed_at_fault = {}, set()
    for kind, window, seen in (("kill_rank", MID_SEGMENT[1], "rank_lost"),
                               ("hang", HANG_AT, "hang")):
        done = strike(chaos, spec, kind, MID_SEGMENT[0], window)
        fault = first_fault(spec, seen)
        committed_at_fault |= set(chaos.durable.list_committed())
        struck[seen] = (done, fault, newest_commit_at_or_before(
            spec, fault["payload"]["last_step"]))
    runner.join(400)
    assert box.get("result", {}).get("status") == "completed", box
    events = read_events(spec.storage.durable, spec.run_id)
    for seen, (done, fault, resume_from) in struck.items():
        assert fault["payload"]["rank"] == done["rank"], (seen, fault["payload"])
        [recovered] = [e["payload"] for e in events if e["kind"] == "recovered"
                       and e["payload"]["fault_event_id"] == fault["event_id"]]
        assert recovered["resumed_step"] == resume_from, (seen, recovered)
        assert recovered["in_place"], (seen, recovered)  # no Temporal retry, no cold start
    final = chaos.durable.list_committed()  # no commit lost, every one the run should have
    assert committed_at_fault <= set(final)
    assert final == list(range(0, spec.train.total_steps + 1, spec.train.checkpoint_every))
    # the corrupted window: a sustained spike, rolled back to a commit before its onset
    rollbacks = [e["payload"] for e in events if e["kind"] == "rollback"]
    assert rollbacks and all(r["to_step"] < CORRUPT_AT <= r["at_step"] for r in rollbacks), \
        rollbacks
    kinds = {e["kind"] for e in events}
    assert {"loss_spike", "rollback", "recovered", "run_finished"} <= kinds, kinds
