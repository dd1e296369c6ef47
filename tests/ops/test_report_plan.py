"""The report's plan chart (ops/report.plan_chart, ops/report_render.draw_plan): the run's
training time by step against `mainspring plan --from-run`'s prediction from its first 10 %,
from literal events whose every time is worked out by hand."""

from __future__ import annotations

import pytest

from ops.report import plan_chart
from ops.report_render import PlanChart, draw_plan, plan_html

T0 = 1_800_000_000.0


def _event(kind: str, ts: float, step: int | None = None, **payload) -> dict:
    return {"kind": kind, "ts": T0 + ts, "step": step, "event_id": f"{kind}/{ts}",
            "payload": payload}


def two_segments() -> list[dict]:
    """Two 100-step segments, a window every 10 steps. Segment 1: 3 s to its first step,
    then 0.5 s a step (window k ends at 3 + 0.5·10k s); it ends at 53 s. Segment 2 starts at
    54 s, 4 s to its first step, the same rate: step 100 + 10k at 58 + 5k; it ends at 109 s."""
    out = [_event("segment_started", 0.0, 0, from_step=0, to_step=100, attempt=1)]
    out += [_event("train_metrics", 3.0 + 5.0 * k, 10 * k, first_step=10 * k - 9,
                   last_step=10 * k, attempt=1, segment="0-100", loss_mean=5.0, steps=10)
            for k in range(1, 11)]
    out += [_event("segment_finished", 53.0, 100, from_step=0, to_step=100, attempt=1),
            _event("segment_started", 54.0, 100, from_step=100, to_step=200, attempt=1)]
    out += [_event("train_metrics", 58.0 + 5.0 * k, 100 + 10 * k, first_step=91 + 10 * k,
                   last_step=100 + 10 * k, attempt=1, segment="100-200", loss_mean=4.0,
                   steps=10) for k in range(1, 11)]
    return [*out, _event("segment_finished", 109.0, 200, from_step=100, to_step=200,
                         attempt=1)]


def test_plan_chart_is_window_times_against_the_prediction_from_the_first_tenth():
    chart = plan_chart(two_segments(), [])
    # the first 20 steps: 0.5 s a step (windows at 8 and 13 s), a 3 s head, no tail seen
    assert chart.seen_steps == 20
    assert chart.figures["seconds_per_step"] == pytest.approx(0.5)
    assert chart.figures["startup_s"] == pytest.approx(3.0)
    assert chart.steps == [10 * k for k in range(1, 21)]
    # actual: the windows' times from the first segment's start, the last one its end
    assert chart.actual_s[:3] == pytest.approx([8.0, 13.0, 18.0])
    assert chart.actual_s[9:12] == pytest.approx([53.0, 63.0, 68.0])
    assert chart.actual_s[-1] == pytest.approx(109.0)
    # predicted: 3 s + 0.5 s·step in segment 1, another 3 s head in segment 2
    assert chart.predicted_s[:3] == pytest.approx([8.0, 13.0, 18.0])
    assert chart.predicted_s[9:12] == pytest.approx([53.0, 61.0, 66.0])
    assert chart.predicted_s[-1] == pytest.approx(2 * 3.0 + 0.5 * 200)  # 106 s
    assert chart.figures["predicted_s"] == chart.predicted_s[-1]
    assert chart.figures["error"] == pytest.approx(106 / 109 - 1)


def test_the_drawn_lines_are_the_charts_numbers():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chart = plan_chart(two_segments(), [])
    fig, ax = plt.subplots()
    try:
        draw_plan(ax, chart)
        actual, predicted = ax.lines
        assert list(actual.get_xdata()) == chart.steps == list(predicted.get_xdata())
        assert list(actual.get_ydata()) == chart.actual_s
        assert list(predicted.get_ydata()) == chart.predicted_s
        assert "first 20 steps" in predicted.get_label()
    finally:
        plt.close(fig)


def test_the_plan_section_tables_the_prediction_and_a_short_run_says_why_there_is_none():
    chart = plan_chart(two_segments(), [])
    page = plan_html(chart, "AAAA", "r1")
    assert "data:image/png;base64,AAAA" in page
    assert "<th>predicted training time (s)</th><td>106</td>" in page
    assert "<th>actual training time (s)</th><td>109</td>" in page
    # the first segment alone, half recorded: its first 10 % (10 steps) holds one window
    short = two_segments()[:6]
    none = plan_chart(short, [])
    assert none.note and none.steps == []
    assert "no prediction: the record has under two step marks" in plan_html(none, "", "r1")
    assert PlanChart(steps=[], actual_s=[], predicted_s=[], seen_steps=0, figures={}).note == ""
