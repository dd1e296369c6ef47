"""A worker lost shortly after an in-place recovery is an incident of its own, end to end.

One rank of a world-size-2 segment is SIGSTOPped mid-segment: the supervisor's hang
timeout fires and the worker restarts the segment in place, whose first step records the
hang's recovery. Later in the same attempt the trainer worker is SIGKILLed (the spec's
injected kill_worker, after step 45: a lost machine). Temporal retries the attempt after its
heartbeat timeout on the restarted worker. From the event log alone: the hang and the worker
loss are two faults, each closed by exactly one `recovered`; the loss's recovery is the
retry's, with the loss's own detection time, and nothing names the hang a second time. Real
Temporal dev server, real workers, real DeepSpeed children on CPU/gloo."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from ops.goodput import fault_summary
from storage.events import read_events
from tests.e2e.runs import chaos_for, run_in_background, strike, tiny_spec

pytestmark = pytest.mark.e2e

KILLED_AFTER = 45
# One 60-step segment at world size 2 (~0.2 s a step on 2 CPU cores); the hang timeout's
# floor lowered so the measured steps decide it (a few seconds); the worker killed after
# step 45 of attempt 1, which its restart in place reaches after the hang's recovery.
RUN = {"train.procs_per_node": 2, "train.total_steps": 60, "train.segment_steps": 60,
       "train.segments_per_run": 1, "train.checkpoint_every": 10,
       "train.micro_batch_tokens": 4096, "sweep.enabled": False,
       "ops.hang_floor_s": 1.0, "ops.heartbeat_timeout_s": 8.0,
       "faults": [{"kind": "kill_worker", "at_step": KILLED_AFTER, "attempt": 1}]}
# strike while steps 22-32 run: past the step-10 commit, well before the kill
MID_SEGMENT = ((0, 60), (22, 32))


def test_a_worker_killed_after_an_in_place_recovery_is_its_own_fault_with_its_own_recovery(
        temporal_server, fleet_factory, tmp_path):
    t0 = time.monotonic()
    spec = tiny_spec("e2e-loss-after-in-place", str(tmp_path / "store"),
                     str(tmp_path / "fast"), **RUN)
    chaos = chaos_for(fleet_factory(restart=True), spec)
    runner, box = run_in_background(temporal_server.address, spec, 400)
    stopped = strike(chaos, spec, "hang", *MID_SEGMENT)
    assert stopped["stopped"], stopped
    runner.join(400)
    assert box.get("result", {}).get("status") == "completed", box

    events = read_events(spec.storage.durable, spec.run_id)
    faults = {e["event_id"]: e for e in events
              if e["kind"] == "fault" and not e["payload"].get("injected")}
    closers = [e for e in events if e["kind"] == "recovered"]
    injected = [e["payload"]["kind"] for e in events
                if e["kind"] == "fault" and e["payload"].get("injected")]
    assert injected == ["kill_worker"], injected
    kinds = {e["payload"]["kind"]: i for i, e in faults.items()}
    assert sorted(kinds) == ["hang", "worker_lost"] and len(kinds) == len(faults), faults
    hang, lost = faults[kinds["hang"]], faults[kinds["worker_lost"]]

    # one recovery per fault, and none of a fault that is not one (or was closed before)
    named = Counter(r["payload"]["fault_event_id"] for r in closers)
    also = [a for r in closers for a in r["payload"].get("also_answers", [])]
    assert named == Counter(list(faults)) and also == [], (named, also)
    by_fault = {r["payload"]["fault_event_id"]: r for r in closers}
    fixed_hang, fixed_loss = by_fault[hang["event_id"]], by_fault[lost["event_id"]]

    # the hang: recovered in place by attempt 1's restart, before the worker was lost
    h, r = hang["payload"], fixed_hang["payload"]
    assert (r["attempt"], r["restart"], r["in_place"]) == (1, 1, True), r
    assert r["detection_s"] == h["detection_s"]
    # the loss: the retry's own record of attempt 1's restart, after the hang was closed
    p, q = lost["payload"], fixed_loss["payload"]
    assert (p["attempt"], p["restart"], p["detected_by"]) == (1, 1, "next_attempt"), p
    assert p["fault_ts"] >= fixed_hang["ts"] - 1.0, (p, fixed_hang)
    assert (q["attempt"], q.get("in_place")) == (2, None), q
    assert q["detection_s"] == p["detection_s"] != h["detection_s"], (p, q, h)
    assert q["resumed_step"] <= KILLED_AFTER <= q["last_step_seen"], q
    # the run's summaries count each incident once, recovered once
    summary, _ = fault_summary(events)
    assert {k: (v["count"], v["recovered"]) for k, v in summary.items()
            if k in ("hang", "worker_lost")} == {"hang": (1, 1), "worker_lost": (1, 1)}
    print(f"\nloss-after-in-place e2e: {time.monotonic() - t0:.1f}s; hang mttr "
          f"{r['mttr_s']}s, loss detection {q['detection_s']}s, mttr {q['mttr_s']}s")
