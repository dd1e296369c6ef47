"""Goodput and badput from the durable record alone (ops/goodput.from_record), on literal
event and span sequences shaped as storage.events.read_events and storage.spans.read_spans
return them. Times are seconds after T0; each step takes 1 s unless a test says otherwise."""

from __future__ import annotations

import itertools

import pytest

from ops.goodput import BADPUT_CAUSES, from_record

T0 = 1_800_000_000.0
_ids = itertools.count()


def ev(event_kind: str, t: float, step: int | None = None, /, **payload) -> dict:
    """An event at T0 + t; `payload` may have a `kind` of its own (a fault's)."""
    return {"event_id": f"{event_kind}/{next(_ids)}", "run_id": "r1", "kind": event_kind,
            "ts": T0 + t, "step": step, "attempt": 1, "trace_id": "", "writer": "w",
            "payload": payload}


def span(name: str, t0: float, t1: float, *, rank: int | None = 0, attempt: int = 1,
         pid: int = 0, **attrs) -> dict:
    """A span record; `rank=None` leaves the attribute out (the process's pid tells it)."""
    tags = {"attempt": attempt, **({} if rank is None else {"rank": rank})}
    return {"trace_id": "ab" * 16, "span_id": f"{next(_ids):016x}", "parent_id": None,
            "name": name, "start_ns": round((T0 + t0) * 1e9), "end_ns": round((T0 + t1) * 1e9),
            "status": "unset", "service": "trainer", "pid": pid or 100 + (rank or 0),
            "attributes": {**tags, **attrs}, "events": []}


def window(first: int, last: int, t0: float, dt: float = 1.0, skipped: tuple = (),
           **kw) -> dict:
    n = last - first + 1
    return span(f"steps {first}-{last}", t0, t0 + n * dt, goodput=True, first_step=first,
                last_step=last, step_times_s=[dt] * n, skipped_steps=list(skipped), **kw)


def run(*middle: dict, end: float = 100.0, train: tuple[float, float] = (0.0, 100.0)) -> list:
    """run_started at 0, the train stage over `train`, run_finished at `end`."""
    return [ev("run_started", 0.0), ev("stage_started", train[0], stage="train"), *middle,
            ev("stage_finished", train[1], stage="train"), ev("run_finished", end)]


def approx(d: dict) -> dict:
    return {k: pytest.approx(v, abs=1e-3) for k, v in d.items()}


def test_fault_free_run_goodput_is_kept_step_time_over_the_wall():
    # startup 0-10 with process_group_init nested in it (counted once), steps 1-80 at 10-90,
    # train stage 5-95, run 0-100: goodput 80/100, train goodput 80/90, other 10 s.
    spans = [span("startup", 0, 10, badput="startup"),
             span("process_group_init", 2, 5, badput="startup"), window(1, 80, 10)]
    out = from_record(run(train=(5.0, 95.0)), spans)
    assert out["wall_s"] == pytest.approx(100.0)
    assert out["goodput"] == pytest.approx(0.8, abs=1e-6)
    assert out["productive_s"] == pytest.approx(80.0)
    assert out["train"] == approx({"wall_s": 90.0, "productive_s": 80.0, "goodput": 80 / 90})
    assert set(out["badput_s"]) == set(BADPUT_CAUSES)
    assert out["badput_s"]["startup"] == pytest.approx(10.0, abs=1e-3)
    assert out["badput_s"]["other"] == pytest.approx(10.0, abs=1e-3)
    assert out["steps"] == {"executed": 80, "kept": 80, "replayed": 0}
    assert out["faults"] == {} and out["injected_faults"] == 0


def test_restore_span_counts_as_restore():
    spans = [span("restore", 10, 14, badput="restore"), window(1, 50, 14)]
    out = from_record(run(), spans)
    assert out["badput_s"]["restore"] == pytest.approx(4.0, abs=1e-3)
    assert out["badput_s"]["other"] == pytest.approx(100 - 50 - 4, abs=1e-3)


def test_checkpoint_stage_span_counts_as_checkpoint_stall():
    spans = [window(1, 10, 0), span("checkpoint stage 10", 10, 11.5, badput="checkpoint_stall"),
             window(11, 20, 11.5)]
    assert from_record(run(), spans)["badput_s"]["checkpoint_stall"] == pytest.approx(1.5, abs=1e-3)


def test_rollback_makes_the_replayed_steps_badput_not_productive():
    # steps 1-14, a spike: rollback to 10 (2 s), steps 11-20 again.
    spans = [window(1, 10, 0), window(11, 14, 10), span("rollback", 14, 16, badput="rollback"),
             window(11, 20, 16)]
    out = from_record(run(ev("rollback", 14, 14, to_step=10)), spans)
    assert out["productive_s"] == pytest.approx(20.0)
    assert out["badput_s"]["replayed"] == pytest.approx(4.0)
    assert out["badput_s"]["rollback"] == pytest.approx(2.0, abs=1e-3)
    assert out["steps"] == {"executed": 24, "kept": 20, "replayed": 4}


def test_killed_attempts_steps_rerun_by_the_retry_are_replayed():
    # Attempt 1 (1 s steps) reaches 15 and dies; attempt 2 (2 s steps) resumes from the
    # checkpoint at 10 and runs 11-20. The span list order is not the time order.
    retry = [span("startup", 40, 45, badput="startup", attempt=2),
             span("restore", 45, 47, badput="restore", attempt=2),
             window(11, 20, 47, dt=2.0, attempt=2)]
    spans = [*retry, window(1, 10, 0), window(11, 15, 10)]
    out = from_record(run(), spans)
    assert out["productive_s"] == pytest.approx(10 * 1.0 + 10 * 2.0)
    assert out["badput_s"]["replayed"] == pytest.approx(5.0)
    assert out["steps"] == {"executed": 25, "kept": 20, "replayed": 5}


def test_vetoed_steps_are_skipped_not_productive():
    out = from_record(run(), [window(1, 10, 0, skipped=(4, 5))])
    assert out["productive_s"] == pytest.approx(8.0)
    assert out["badput_s"]["skipped"] == pytest.approx(2.0)
    assert out["badput_s"]["replayed"] == 0.0
    assert out["train"]["productive_s"] == pytest.approx(8.0)


def test_a_vetoed_step_replaced_by_a_rollback_replay_is_replayed_not_skipped():
    spans = [window(1, 12, 0, skipped=(11, 12)), window(11, 12, 20)]
    out = from_record(run(), spans)
    assert out["badput_s"]["skipped"] == 0.0
    assert out["badput_s"]["replayed"] == pytest.approx(2.0)
    assert out["productive_s"] == pytest.approx(12.0)


def test_holds_count_as_paused_until_resumed_or_the_end():
    events = run(ev("paused", 30, reason="operator"), ev("run_resumed", 50),
                 ev("needs_attention", 80, reason="spikes"),
                 ev("paused", 85, reason="again, while held"))
    out = from_record(events, [window(1, 10, 0)])
    assert out["badput_s"]["paused"] == pytest.approx(20.0 + 20.0)  # 30-50, 80-end (100)


def test_a_needs_attention_that_held_nothing_is_not_paused_time():
    events = run(ev("needs_attention", 30, reason="checkpoint step 20 is corrupt", held=False))
    out = from_record(events, [window(1, 10, 0)])
    assert out["badput_s"]["paused"] == 0.0


def test_fault_detection_time_counts_as_detection():
    events = run(ev("fault", 30, 20, kind="worker_lost", evidence="no heartbeat"),
                 ev("recovered", 40, 20, resumed_step=20, lost_steps=3, detection_s=6.5,
                    restart_s=2.0, restore_s=1.0, mttr_s=9.5, attempt=2))
    out = from_record(events, [window(1, 23, 0), window(21, 40, 40)])
    assert out["badput_s"]["detection"] == pytest.approx(6.5)
    assert out["faults"] == {"worker_lost": {"count": 1, "recovered": 1, "mttr_s_median": 9.5,
                                             "mttr_s_max": 9.5, "lost_steps": 3}}


def test_sweep_and_data_stages_count_whole_and_their_trial_steps_are_not_the_runs():
    events = [ev("run_started", 0.0), ev("stage_started", 0, stage="prepare_data"),
              ev("stage_finished", 10, stage="prepare_data"),
              ev("stage_started", 10, stage="warmup_sweep"),
              ev("stage_finished", 30, stage="warmup_sweep"),
              ev("stage_started", 30, stage="train"), ev("stage_finished", 100, stage="train"),
              ev("run_finished", 100)]
    trial = [span("startup", 11, 13, badput="startup"), window(1, 5, 13)]
    out = from_record(events, [*trial, window(1, 50, 40)])
    assert out["badput_s"]["data"] == pytest.approx(10.0)
    assert out["badput_s"]["sweep"] == pytest.approx(20.0)
    assert out["badput_s"]["startup"] == 0.0 and out["badput_s"]["replayed"] == 0.0
    assert out["steps"] == {"executed": 50, "kept": 50, "replayed": 0}
    assert out["train"] == approx({"wall_s": 70.0, "productive_s": 50.0, "goodput": 50 / 70})


def test_online_eval_spans_and_the_evaluate_stage_count_as_evaluation():
    events = run(ev("stage_started", 100, stage="evaluate"),
                 ev("stage_finished", 110, stage="evaluate"), end=120, train=(0.0, 100.0))
    spans = [window(1, 10, 0), span("online_eval", 10, 13, badput="evaluation"),
             window(11, 20, 13)]
    assert from_record(events, spans)["badput_s"]["evaluation"] == pytest.approx(13.0, abs=1e-3)


def test_injected_faults_are_counted_apart_from_real_faults():
    # A chaos kill, a NaN loss from inside, and the real fault the supervisor saw: only
    # that one is a fault, and the recovery (naming no fault) answers it.
    events = run(ev("fault", 20, 10, kind="kill_worker", injected=True),
                 ev("fault", 25, 10, kind="worker_lost", evidence="heartbeat timeout"),
                 ev("recovered", 35, 10, resumed_step=10, lost_steps=2, mttr_s=15.0),
                 ev("fault", 50, 30, kind="nan_loss", injected=True))
    out = from_record(events, [window(1, 12, 0)])
    assert out["injected_faults"] == 2
    assert out["faults"] == {"worker_lost": {"count": 1, "recovered": 1, "mttr_s_median": 15.0,
                                             "mttr_s_max": 15.0, "lost_steps": 2}}


def test_mttr_is_summarised_per_fault_kind_across_two_faults():
    lost1, lost2 = ev("fault", 10, 5, kind="worker_lost"), ev("fault", 40, 30, kind="worker_lost")
    hang1, hang2 = ev("fault", 60, 50, kind="hang"), ev("fault", 90, 70, kind="hang")
    events = run(lost1, lost2, hang1, hang2,  # recoveries name their faults, out of order
                 ev("recovered", 52, 30, fault_event_id=lost2["event_id"], mttr_s=12.0,
                    lost_steps=4),
                 ev("recovered", 53, 5, fault_event_id=lost1["event_id"], mttr_s=20.0,
                    lost_steps=1),
                 ev("recovered", 75, 50, fault_event_id=hang1["event_id"], lost_steps=7))
    out = from_record(events, [window(1, 10, 0)])
    assert out["faults"]["worker_lost"] == {"count": 2, "recovered": 2, "mttr_s_median": 16.0,
                                            "mttr_s_max": 20.0, "lost_steps": 5}
    # no mttr_s in the payload: fault -> recovered event, 15 s; the second hang never recovered
    assert out["faults"]["hang"] == {"count": 2, "recovered": 1, "mttr_s_median": 15.0,
                                     "mttr_s_max": 15.0, "lost_steps": 7}


def test_only_rank_zero_trainer_spans_are_counted():
    spans = [window(1, 10, 0), window(1, 10, 0.2, rank=1), span("restore", 10, 12, rank=1,
                                                               badput="restore")]
    out = from_record(run(), spans)
    assert out["steps"]["executed"] == 10 and out["badput_s"]["replayed"] == 0.0
    assert out["badput_s"]["restore"] == 0.0


def test_live_run_ends_at_now_or_at_the_newest_record():
    events = [ev("run_started", 0.0), ev("stage_started", 0, stage="train")]
    spans = [window(1, 20, 0)]
    assert from_record(events, spans, now=T0 + 40)["wall_s"] == pytest.approx(40.0)
    live = from_record(events, spans)
    assert live["wall_s"] == pytest.approx(20.0, abs=1e-3)
    assert live["train"]["goodput"] == pytest.approx(1.0, abs=1e-6)


def test_empty_record_has_no_goodput():
    out = from_record([], [])
    assert out["wall_s"] == 0.0 and out["goodput"] is None and out["train"]["goodput"] is None


def test_a_trainer_span_without_rank_is_its_processes_and_other_spans_are_ignored():
    # rank 1's startup (pid 101) and rank 0's (pid 100) carry no rank attribute; a
    # productive span that is no step window, and a workflow span, are not step time.
    spans = [span("startup", 0, 4, rank=None, pid=100, badput="startup"),
             span("startup", 0, 9, rank=None, pid=101, badput="startup"),
             span("trainer rank 0", 0, 30, pid=100), span("trainer rank 1", 0, 30, rank=1),
             span("forward", 4, 5, pid=100, goodput=True),
             span("segment 0-10", 0, 30, rank=None, pid=7, goodput=True),
             window(1, 10, 4)]
    out = from_record(run(), spans)
    assert out["badput_s"]["startup"] == pytest.approx(4.0, abs=1e-3)
    assert out["productive_s"] == pytest.approx(10.0)
    assert out["steps"]["executed"] == 10
