"""Goodput accounting (ops/goodput.py) on literal progress lines and events."""

from __future__ import annotations

import pytest

from ops.goodput import (
    downtime,
    fault_outcome,
    final_trajectory,
    human_actions,
    longest_gap,
    projected_goodput,
    spike_outcomes,
    summarize_recoveries,
    time_budget,
)


def step(n: int, ts: float, dt: float = 1.0, verdict: str = "ok") -> dict:
    return {"type": "step", "step": n, "ts": ts, "step_time_s": dt, "verdict": verdict}


def start(ts: float, resumed_from: int | None, attempt: int = 2) -> dict:
    return {"type": "start", "ts": ts, "resumed_from": resumed_from, "attempt": attempt}


# Steps 1-3, a kill at t=3.5, a restart at t=20 from the checkpoint at step 2, steps 3-4.
KILLED = [start(0.0, None, attempt=1), step(1, 1.0), step(2, 2.0), step(3, 3.0),
          start(20.0, 2), step(3, 21.0), step(4, 22.0)]


def test_final_trajectory_keeps_the_last_execution_of_each_step():
    kept = final_trajectory([s for s in KILLED if s["type"] == "step"])
    assert sorted(kept) == [1, 2, 3, 4]
    assert kept[3]["ts"] == 21.0


def test_replayed_steps_and_downtime_are_not_productive():
    budget = time_budget([s for s in KILLED if s["type"] == "step"], wall_s=25.0, pauses_s=1.0)
    assert budget["productive_s"] == 4.0 and budget["replayed_s"] == 1.0
    assert budget["goodput"] == pytest.approx(4.0 / 25.0)
    assert budget["other_s"] == pytest.approx(25.0 - 4.0 - 1.0 - 1.0)
    assert budget["steps_replayed"] == 1


def test_a_skipped_step_in_the_final_trajectory_is_wasted():
    budget = time_budget([step(1, 1.0), step(2, 2.0, verdict="skip"), step(3, 3.0)], wall_s=3.0)
    assert budget["productive_s"] == 2.0 and budget["skipped_s"] == 1.0


def test_fault_outcome_measures_recovery_to_the_first_new_step_and_lost_steps():
    out = fault_outcome(3.5, KILLED)
    assert out["recovered"] and out["restarted"] and out["attempts"] == 1
    assert out["recovery_s"] == pytest.approx(21.0 - 3.5)
    assert out["lost_steps"] == 1 and out["resumed_from"] == 2 and out["first_step_after"] == 3


def test_lost_steps_count_from_where_the_interrupted_attempt_had_got_to():
    second = fault_outcome(22.5, [*KILLED, start(40.0, 4), step(5, 41.0)])
    assert second["last_step_before"] == 4 and second["lost_steps"] == 0
    replayed = [*KILLED[:5], step(3, 21.0), start(30.0, 2), step(3, 31.0)]  # killed again at 3
    assert fault_outcome(25.0, replayed)["lost_steps"] == 1


def test_projection_removes_the_faults_cost_then_charges_it_per_interval():
    budget = time_budget([s for s in KILLED if s["type"] == "step"], wall_s=25.0)
    outcomes = [fault_outcome(3.5, KILLED)]  # 17.5 s down + 1 s replayed
    proj = projected_goodput(budget, outcomes, faults=1, intervals_s=[185.0])
    assert proj["cost_per_fault_s"] == pytest.approx(18.5)
    assert proj["fault_free"] == pytest.approx(4.0 / (25.0 - 18.5))
    assert proj["fault_every_185s"] == pytest.approx(4.0 / 6.5 * 0.9)


def test_a_step_the_dying_rank_finishes_after_the_fault_is_not_the_recovery():
    lines = [*KILLED[:4], step(4, 3.6), start(20.0, 2), step(3, 21.0)]
    out = fault_outcome(3.5, lines)
    assert out["recovery_s"] == pytest.approx(21.0 - 3.5) and out["lost_steps"] == 2


def test_a_new_segment_or_a_restart_after_the_next_fault_is_not_this_faults_restart():
    lines = [step(1, 1.0), step(2, 2.0), start(5.0, 2, attempt=1), step(3, 6.0),
             start(30.0, 2), step(3, 31.0)]
    out = fault_outcome(1.5, lines, until_ts=20.0)
    assert not out["restarted"] and out["first_step_after"] == 2


def test_a_next_segment_that_falls_back_to_an_earlier_checkpoint_is_a_restart():
    # the fault hit at a segment's end (step 3, committed at t=3.0) and spoiled that
    # checkpoint: the next segment's first attempt resumes from step 2 and replays step 3
    lines = [step(1, 1.0), step(2, 2.0), step(3, 3.0), start(9.0, 2, attempt=1), step(3, 10.0)]
    out = fault_outcome(3.5, lines)
    assert out["restarted"] and out["resumed_from"] == 2 and out["lost_steps"] == 1
    assert out["recovery_s"] == pytest.approx(10.0 - 3.5)


def test_a_fault_training_runs_through_loses_nothing():
    lines = [step(1, 1.0), step(2, 2.0), step(3, 9.0), step(4, 10.0)]
    out = fault_outcome(1.5, lines)
    assert not out["restarted"] and out["lost_steps"] == 0
    assert longest_gap(lines, 1.5, 12.0) == pytest.approx(7.0)


def test_downtime_leaves_out_the_steps_that_ran_inside_the_recovery_window():
    lines = [*KILLED[:4], step(4, 3.6, dt=0.5), start(20.0, 2), step(3, 21.0)]
    # window 3.5 -> 21.0: the dying rank's step 4 (0.5 s) and the first new step (1 s) ran
    assert downtime(3.5, 17.5, lines) == pytest.approx(17.5 - 1.5)
    assert downtime(30.0, 5.0, lines) == 5.0


def test_a_fault_with_no_step_after_it_did_not_recover():
    assert fault_outcome(30.0, KILLED) == {"recovered": False}


def test_recoveries_are_counted_against_timeout_plus_ten_seconds():
    outcomes = [{"kind": "kill_worker", "recovered": True, "recovery_s": 19.0, "lost_steps": 5},
                {"kind": "kill_worker", "recovered": True, "recovery_s": 21.0, "lost_steps": 9},
                {"kind": "hang", "recovered": False}]
    summary = summarize_recoveries(outcomes, {"kill_worker": 10.0, "hang": 30.0})
    assert summary["kill_worker"]["within_bound"] == 1 and summary["kill_worker"]["bound_s"] == 20.0
    assert summary["kill_worker"]["lost_steps_max"] == 9
    assert summary["hang"] == {"faults": 1, "recovered": 0, "recovery_s_median": None,
                               "recovery_s_max": None, "bound_s": 40.0, "within_bound": 0,
                               "lost_steps_max": None}


def event(event_kind: str, step: int, ts: float, **payload) -> dict:
    return {"kind": event_kind, "step": step, "ts": ts, "payload": payload}


def fault(step: int, ts: float, kind: str) -> dict:
    return event("fault", step, ts, kind=kind, injected=True)


def test_spike_faults_are_matched_to_the_decisions_that_handled_them():
    events = [fault(30, 1.0, "corrupt_batches"),
              event("batch_skipped", 30, 1.1), event("rollback", 32, 1.2, lost_steps=7),
              fault(150, 2.0, "nan_loss"), event("batch_skipped", 150, 2.1),
              fault(170, 3.0, "kill_worker"),
              fault(300, 4.0, "lr_burst"), event("batch_skipped", 400, 4.5)]
    out = spike_outcomes(events, window_steps=50)
    assert [(o["kind"], o["handled"], o["skips"], o["wasted_steps"]) for o in out] == [
        ("corrupt_batches", "rollback", 1, 8), ("nan_loss", "skip", 1, 1),
        ("lr_burst", None, 0, 0)]


def test_operator_commands_and_pauses_count_as_human_actions():
    events = [event("rollback", 1, 1.0), event("needs_attention", 2, 2.0),
              event("operator", 2, 3.0), event("run_resumed", 2, 4.0)]
    assert human_actions(events) == 3
    assert human_actions(events[:1]) == 0


def test_the_scrubs_needs_attention_holds_nothing_and_is_no_human_action():
    scrub_alarm = event("needs_attention", 2, 2.0, held=False)
    assert human_actions([scrub_alarm, event("operator", 2, 3.0)]) == 1
