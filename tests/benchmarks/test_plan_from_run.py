"""benchmarks/plan_from_run.py: its figures from literal recorded runs (no services)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.plan_from_run import (
    QUICK_STEPS,
    SEGMENT_STEPS,
    STEPS,
    adjusted,
    figures,
    report,
    run_lengths,
)


def recorded(run_id: str, steps: int, head_s: float, step_s: float, end_s: float) -> dict:
    """One segment of `steps` steps, a window every 10: `head_s` to the first step, then
    `step_s` a step; it ends at `end_s`."""
    t0 = 1_800_000_000.0
    events = [{"kind": "segment_started", "ts": t0, "step": 0, "event_id": "s",
               "payload": {"from_step": 0, "to_step": steps, "attempt": 1}}]
    events += [{"kind": "train_metrics", "ts": t0 + head_s + step_s * k, "step": k,
                "event_id": f"w{k}", "payload": {"first_step": k - 9, "last_step": k,
                                                 "attempt": 1, "segment": f"0-{steps}"}}
               for k in range(10, steps + 1, 10)]
    events.append({"kind": "segment_finished", "ts": t0 + end_s, "step": steps,
                   "event_id": "f", "payload": {"from_step": 0, "to_step": steps,
                                                "attempt": 1}})
    return {"run_id": run_id, "status": "completed", "events": events, "spans": []}


def test_each_run_is_predicted_from_its_first_tenth_and_the_worst_error_is_judged():
    # 2 s head and 0.1 s a step: 200 steps foresee 2 + 20 = 22 s; they took 22 (0 %);
    # 400 steps foresee 42 s and took 50 (-16 %): over the bound
    raw = {"runs": [recorded("a", 200, 2.0, 0.1, 22.0), recorded("b", 400, 2.0, 0.1, 50.0)],
           "loads": [0.5], "segment_steps": 400, "checkpoint_every": 10, "cpus": 2,
           "model": {"d_model": 128}}
    out = report(raw)
    a, b = out["runs"]
    assert (a["seen_steps"], a["predicted_s"], a["error"]) == (20, 22.0, 0.0)
    assert (b["seen_steps"], b["predicted_s"]) == (40, 42.0)
    assert b["error"] == pytest.approx(42 / 50 - 1, abs=1e-3)
    assert out["max_abs_error"] == pytest.approx(0.16, abs=1e-3)
    assert out["within_15pct"] is False
    assert out["inputs"]["segment_steps"] == 400 and out["statuses"] == ["completed"] * 2


def test_the_bound_is_fifteen_percent_either_way():
    rows = [{"run_id": "x", "total_steps": 1, "segments": 1, "seen_steps": 1,
             "marks_from": "spans", "seconds_per_step": 1.0, "startup_s": 0.0, "tail_s": 0.0,
             "predicted_s": 1.0, "actual_s": 1.0, "error": e, "faults": 0, "finished": True}
            for e in (0.1, -0.15)]
    assert figures(rows)["within_15pct"] is True
    assert figures([*rows, {**rows[0], "error": 0.151}])["within_15pct"] is False


def test_quick_runs_keep_the_segment_counts_of_the_full_ones():
    full = run_lengths(argparse.Namespace(quick=False, steps=list(STEPS),
                                          segment_steps=SEGMENT_STEPS))
    quick = run_lengths(argparse.Namespace(quick=True, steps=list(STEPS),
                                           segment_steps=SEGMENT_STEPS))
    assert quick[0] == QUICK_STEPS
    assert [-(-s // quick[1]) for s in quick[0]] == [-(-s // full[1]) for s in full[0]]
    assert full == (STEPS, SEGMENT_STEPS) == ((800, 1600, 3200), 400)


def test_the_shortest_full_run_sees_past_a_segments_start_up_work():
    # the segment's start-up work slows its first ~40-80 steps here: the prediction's 10 %
    # of the shortest run must reach past them
    assert min(STEPS) // 10 >= 80


def test_the_load_adjusted_prediction_stretches_what_follows_the_prefix_by_the_cpu_share():
    # 3 s head and 0.1 s a step: steps 1-20 end at 5 s, 200 foresee 23 s. Beside one other
    # job the trainer had a core of its own (2 cores); beside three, half of one: the 18 s
    # after the prefix take 36, and the run's 41 s are foreseen exactly
    p = {"total_steps": 200, "segment_steps": 200, "startup_s": 3.0, "tail_s": 0.0,
         "seconds_per_step": 0.1, "seen_steps": 20, "predicted_s": 23.0, "actual_s": 41.0,
         "start_ts": 0.0, "seen_ts": 5.0}
    got = adjusted(p, [(1.0, 1), (4.0, 1), (10.0, 3), (30.0, 3)], 0.0, 41.0, cores=2)
    assert (got["background_prefix"], got["background_rest"]) == (1, 3)
    assert got["stretch"] == pytest.approx(2.0)
    assert got["load_adjusted_predicted_s"] == pytest.approx(5.0 + 18.0 * 2)
    assert got["load_adjusted_error"] == pytest.approx(0.0)
