"""The recovery benchmark's arithmetic (benchmarks/recovery_marks.py), on literal records: the
parts of an MTTR add up to it, a missing mark lands in `unaccounted`, the relaunch is read
from the spans, progress lines and worker log it left, and the per-kind summary."""

from __future__ import annotations

import pytest

from benchmarks.recovery_marks import (
    answer,
    fault_report,
    launch_marks,
    percentile,
    split,
    summarize,
    target_s,
    unexplained,
)

S = 1_000_000_000  # ns per s


def span(name: str, start: float, end: float, pid: int = 7, **attributes) -> dict:
    return {"name": name, "start_ns": int(start * S), "end_ns": int(end * S), "pid": pid,
            "trace_id": "t", "span_id": f"{name}{start}", "attributes": {"rank": 0, **attributes}}


def test_percentile_interpolates_between_order_statistics_and_skips_none():
    assert percentile([3.0, 1.0, 2.0, None], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0
    assert percentile([None], 50) is None


def test_the_parts_of_an_mttr_sum_to_it_with_nothing_unaccounted():
    parts = split({"strike": 100.0, "detected": 105.5, "launched": 106.0,
                   "restore_began": 107.5, "restored": 107.75, "first_step": 108.0})
    assert parts == {"detection": 5.5, "scheduling": 0.5, "startup": 1.5, "restore": 0.25,
                     "first_step": 0.25, "unaccounted": 0.0}


def test_a_missing_mark_puts_both_its_parts_into_unaccounted():
    parts = split({"strike": 100.0, "detected": 101.0, "launched": None,
                   "restore_began": 103.0, "restored": 103.5, "first_step": 104.0})
    assert parts["scheduling"] is None and parts["startup"] is None
    assert parts["unaccounted"] == 2.0
    assert sum(v for v in parts.values() if v is not None) == 4.0


def test_targets_are_heartbeat_plus_3_six_seconds_and_the_hangs_own_timeout_plus_3():
    assert target_s("kill_worker", 5.0, {}) == 8.0
    assert target_s("kill_rank", 5.0, {}) == 6.0
    assert target_s("hang", 5.0, {"timeout_s": 2.5}) == 5.5
    assert target_s("hang", 5.0, {}) is None


EVENTS = [
    {"kind": "fault", "ts": 105.6, "step": 40, "event_id": "fault/0-300/x/1",
     "payload": {"kind": "worker_lost", "detected_ts": 105.5, "heartbeat_ts": 99.4}},
    {"kind": "recovered", "ts": 108.1, "step": 40, "event_id": "recovered/0-300/x/2",
     "payload": {"fault_event_id": "fault/0-300/x/1", "attempt": 2, "tier": "fast",
                 "lost_steps": 3, "mttr_s": 8.6}},
    {"kind": "fault", "ts": 150.0, "step": 90, "event_id": "fault/0-300/x/2.1",
     "payload": {"kind": "hang", "detected_ts": 150.0, "timeout_s": 2.5}},
]
LINES = [{"type": "step", "step": 43, "ts": 99.9, "step_time_s": 0.15},
         {"type": "start", "attempt": 2, "restart": 0, "ts": 107.8, "restore_s": 0.25},
         {"type": "step", "step": 41, "ts": 108.0, "step_time_s": 0.15}]
# the relaunch's process (pid 7) and the one before it (pid 6); a process's startup span reads
# early (psutil's create time), so it is found by its process, not by when it starts
SPANS = [span("startup", 89.0, 89.5, pid=6), span("process_group_init", 89.5, 89.9, pid=6),
         span("restore", 90.0, 90.5, pid=6), span("startup", 105.5, 106.25),
         span("process_group_init", 106.5, 107.25), span("restore", 107.5, 107.75),
         span("segment 0-300", 105.75, 109.0, attempt=2, rank=None)]
LOGS = [{"event": "standby_ready", "ts": 105.9, "file": "b.log"},
        {"event": "child_started", "ts": 106.0, "warm": True, "file": "b.log"}]


def test_the_relaunch_is_read_from_the_worker_log_spans_and_progress_lines():
    strike = {"kind": "kill_worker", "ts": 100.0}
    fault, rec = answer(strike, EVENTS, 140.0)
    assert fault["event_id"] == "fault/0-300/x/1" and rec["ts"] == 108.1
    marks, sources, detail = launch_marks(strike, fault, rec, LINES, SPANS, LOGS)
    assert marks == {"strike": 100.0, "detected": 105.5, "launched": 106.0,
                     "restore_began": 107.5, "restored": 107.75, "first_step": 108.0}
    assert sources["launched"] == "worker log child_started"
    assert sources["restore_began"] == "span restore"
    assert detail["warm"] is True and detail["waited_for_standby"] is True
    assert detail["dispatch_s"] == 0.25 and detail["prepare_s"] == 0.25
    # start-up (1.5 s) = before process_group_init + the span + after it, to the restore
    assert (detail["pre_init_s"], detail["process_group_init_s"], detail["post_init_s"]) \
        == (0.5, 0.75, 0.25)
    assert detail["heartbeat_age_at_strike_s"] == pytest.approx(0.6)
    assert detail["detected_after_heartbeat_s"] == pytest.approx(6.1)
    assert detail["before_first_step_s"] == pytest.approx(0.1)


def test_without_spans_or_a_log_line_the_start_line_and_process_start_stand_in():
    strike = {"kind": "kill_worker", "ts": 100.0}
    fault, rec = answer(strike, EVENTS, 140.0)
    marks, sources, _ = launch_marks(strike, fault, rec, LINES, [], [])
    assert marks["launched"] is None and sources["launched"] is None
    assert marks["restore_began"] == pytest.approx(107.55) and marks["restored"] == 107.8
    row = fault_report(strike, EVENTS, 140.0, LINES, [], [], 5.0)
    assert row["mttr_s"] == 8.0 and row["target_s"] == 8.0
    assert row["breakdown"]["unaccounted"] == pytest.approx(2.05)


def test_a_fault_with_no_recovered_event_is_reported_unrecovered():
    row = fault_report({"kind": "hang", "ts": 149.0}, EVENTS, 200.0, LINES, SPANS, LOGS, 5.0)
    assert (row["recorded"], row["recovered"]) == ("hang", False)


def test_a_fault_no_strike_caused_is_unexplained():
    assert unexplained([{"kind": "kill_worker", "ts": 100.0}], EVENTS[:2]) == []
    assert [f["kind"] for f in unexplained([{"kind": "kill_worker", "ts": 100.0},
                                            {"kind": "kill_rank", "ts": 200.0}], EVENTS)] \
        == ["hang"]


def fault(kind: str, mttr: float, target: float, **extra) -> dict:
    parts = {"detection": mttr - 1.0, "scheduling": 0.25, "startup": 0.5, "restore": 0.125,
             "first_step": 0.125, "unaccounted": 0.0}
    return {"kind": kind, "recovered": True, "mttr_s": mttr, "target_s": target,
            "breakdown": parts, "recorded": "rank_lost", "tier": "fast", "warm": True,
            "in_place": True, "lost_steps": 4, **extra}


def test_the_summary_gives_p50_p95_and_the_median_faults_breakdown_against_the_target():
    faults = [fault("kill_rank", m, 6.0, detail={"pre_init_s": m / 4}) for m in (4.0, 5.0, 7.0)] + [
        fault("hang", 6.0, 5.5, in_place=True), fault("hang", 5.0, 5.5)]
    s = summarize(faults)
    rank = s["kill_rank"]
    assert (rank["n"], rank["mttr_p50_s"], rank["mttr_max_s"]) == (3, 5.0, 7.0)
    assert rank["mttr_p95_s"] == pytest.approx(6.8)
    assert rank["met"] and rank["within_target"] == 2
    assert rank["breakdown_of_median_fault"]["detection"] == 4.0
    assert sum(rank["breakdown_of_median_fault"].values()) == rank["mttr_p50_s"]
    assert rank["breakdown_p50_s"]["detection"] == 4.0
    assert (rank["in_place"], rank["warm_launches"], rank["tiers"]) == (3, 3, {"fast": 3})
    assert rank["detail_p50_s"] == {"pre_init_s": 1.25}
    assert s["hang"]["mttr_p50_s"] == 5.5 and s["hang"]["met"]  # margins -0.5 and +0.5
