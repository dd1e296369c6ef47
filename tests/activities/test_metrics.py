"""Durable training metrics (activities/metrics.py): the pure window summary and the
forwarder's windows, tail and event ids, fed literal progress lines."""

from __future__ import annotations

import math

import pytest

from activities.metrics import MetricsForwarder, aggregate
from common.protocol import CommitLine, EvalLine, StartLine, StepLine
from storage.events import EventLog, read_events


def step(n: int, loss: float | None = 2.0, verdict: str = "ok", **extra) -> StepLine:
    return StepLine(**{"step": n, "loss": loss, "lr": 1e-3 * n, "verdict": verdict,
                       "tokens_per_s": 100.0 * n, "step_time_s": 0.1, "mfu": 0.01 * n,
                       "peak_mem_bytes": 1000 + n, **extra})


def test_aggregate_excludes_nonfinite_losses_and_counts_skips():
    lines = [step(1, 3.0), step(2, None, "skip"), step(3, math.nan, "skip"), step(4, 1.0),
             step(5, 8.0, "skip")]
    out = aggregate(lines)
    assert (out["first_step"], out["last_step"], out["steps"]) == (1, 5, 5)
    assert out["loss_mean"] == pytest.approx(4.0)  # (3 + 1 + 8) / 3: null and NaN left out
    assert (out["loss_min"], out["loss_max"]) == (1.0, 8.0)
    assert out["nonfinite"] == 2
    assert out["skipped"] == 3
    assert out["lr"] == pytest.approx(5e-3)  # the window's last
    assert out["tokens_per_s"] == pytest.approx(300.0)  # mean
    assert out["mfu"] == pytest.approx(0.03)
    assert out["peak_mem_bytes"] == 1005  # max


def test_aggregate_of_only_nonfinite_losses_gives_null_band():
    out = aggregate([step(7, None), step(8, math.inf)])
    assert out["loss_mean"] is None and out["loss_min"] is None and out["loss_max"] is None
    assert out["nonfinite"] == 2


def test_aggregate_without_mfu_or_memory_reports_null():
    lines = [StepLine(step=1, loss=2.5, lr=0.1, verdict="ok")]
    out = aggregate(lines)
    assert out["mfu"] is None and out["tokens_per_s"] is None and out["peak_mem_bytes"] is None
    assert out["loss_mean"] == 2.5


def forwarded(tmp_path, lines, every=10, attempt=1, segment="0-80"):
    events = EventLog(str(tmp_path), "r", "supervisor", attempt=attempt)
    fwd = MetricsForwarder(events, every, segment=segment, attempt=attempt)
    for line in lines:
        fwd.on_progress(line)
    return events, fwd


def metrics(tmp_path) -> list[dict]:
    return [e for e in read_events(str(tmp_path), "r", ("train_metrics",))]


def test_windows_end_on_multiples_of_every_and_close_emits_the_tail(tmp_path):
    # A segment resumed at step 5: windows 5-10, 11-20, then the tail 21-23 on close().
    lines = [StartLine(resumed_from=4, world_size=1, to_step=24, attempt=1)] + [step(n) for n in range(5, 24)]
    events, fwd = forwarded(tmp_path, lines)
    events.flush()
    assert [(e["payload"]["first_step"], e["payload"]["last_step"]) for e in metrics(tmp_path)
            ] == [(5, 10), (11, 20)]
    fwd.close()
    events.flush()
    got = metrics(tmp_path)
    assert [(e["payload"]["first_step"], e["payload"]["last_step"]) for e in got
            ] == [(5, 10), (11, 20), (21, 23)]
    assert got[-1]["step"] == 23 and got[-1]["payload"]["segment"] == "0-80"


def test_commit_line_makes_the_windows_so_far_durable(tmp_path):
    _, _ = forwarded(tmp_path, [step(n) for n in range(1, 11)] + [
        CommitLine(step=10, uri="x"), step(11)])
    assert [e["payload"]["last_step"] for e in metrics(tmp_path)] == [10]


def test_rollback_replay_gets_its_own_windows_and_distinct_ids(tmp_path):
    # Steps 1-14 run, a rollback at 14 restores step 8: 9.. replay in the same attempt.
    lines = [step(n, 2.0) for n in range(1, 15)] + [step(n, 1.5) for n in range(9, 21)]
    events, fwd = forwarded(tmp_path, lines)
    fwd.close()
    events.flush()
    got = metrics(tmp_path)
    spans = [(e["payload"]["first_step"], e["payload"]["last_step"]) for e in got]
    assert spans == [(1, 10), (11, 14), (9, 10), (11, 20)]
    assert len({e["event_id"] for e in got}) == 4
    assert [e["payload"]["loss_mean"] for e in got] == [2.0, 2.0, 1.5, 1.5]


def test_retry_attempt_replaying_the_same_steps_is_not_deduplicated_away(tmp_path):
    for attempt, loss in ((1, 2.0), (2, 1.0)):
        events, fwd = forwarded(tmp_path, [step(n, loss) for n in range(1, 11)],
                                attempt=attempt)
        fwd.close()
        events.flush()
    got = metrics(tmp_path)
    assert sorted(e["event_id"] for e in got) == ["train_metrics/0-80/1/0",
                                                  "train_metrics/0-80/2/0"]
    assert sorted(e["payload"]["loss_mean"] for e in got) == [1.0, 2.0]


def test_same_bounds_scheduled_twice_keep_both_with_an_execution_label(tmp_path):
    # A segment that stopped at its first step is run again with the same bounds, attempt 1.
    for execution, loss in (("wf1.7", 2.0), ("wf1.9", 1.0)):
        events = EventLog(str(tmp_path), "r", "supervisor", attempt=1)
        fwd = MetricsForwarder(events, 10, segment="40-80", attempt=1, execution=execution)
        for n in range(41, 46):
            fwd.on_progress(step(n, loss))
        fwd.close()
        events.flush()
    got = metrics(tmp_path)
    assert sorted(e["event_id"] for e in got) == ["train_metrics/40-80/wf1.7/1/0",
                                                  "train_metrics/40-80/wf1.9/1/0"]


def test_reemitting_the_same_window_deduplicates_on_read(tmp_path):
    # A flush retried by a second forwarder of the same attempt writes the same ids again.
    for _ in range(2):
        events, fwd = forwarded(tmp_path, [step(n) for n in range(1, 6)])
        fwd.close()
        events.flush()
    assert len(metrics(tmp_path)) == 1


def test_non_step_lines_and_every_below_one_are_handled(tmp_path):
    events, fwd = forwarded(tmp_path, [EvalLine(step=10, val_loss=1.0)])
    fwd.close()
    events.flush()
    assert metrics(tmp_path) == []
    with pytest.raises(ValueError, match="every"):
        MetricsForwarder(events, 0, segment="s", attempt=1)


def test_unreachable_store_at_a_commit_defers_the_flush_without_losing_windows(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the store's directory should be")
    events = EventLog(str(blocked), "r", "supervisor", attempt=1)
    fwd = MetricsForwarder(events, 5, segment="0-10", attempt=1)
    for n in range(1, 6):
        fwd.on_progress(step(n))
    fwd.on_progress(CommitLine(step=5, uri="x"))  # flush fails: no raise
    assert read_events(str(blocked), "r") == []
    blocked.unlink()  # the store is back: the next flush writes the window kept for it
    events.flush()
    assert [e["kind"] for e in read_events(str(blocked), "r")] == ["train_metrics"]
