"""Where a step's wall time goes, owner by owner (trainer/step_metrics.py OwnerClock, lapped
by trainer/loop.py): the laps are gapless, so the owners add up to the loop period, and the
segment writes them once, at its end, to `step_owners.json` (benchmarks/overhead.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.test_step_loop import fresh, segment, step_lines
from trainer.step_metrics import OWNERS, RECENT_STEPS, OwnerClock, owner_summary


def test_owner_summary_gives_means_over_all_steps_and_medians_over_the_recent_ones():
    total = dict.fromkeys(OWNERS, 0.0)
    recent = {o: [0.0] * RECENT_STEPS for o in OWNERS}
    total["update"], recent["update"][:3] = 0.009, [0.001, 0.002, 0.006]
    total["report"], recent["report"][:3] = 0.0003, [0.0001] * 3
    out = owner_summary(total, recent, 3)
    assert out["steps"] == 3
    assert out["mean_ms"]["update"] == pytest.approx(3.0)
    assert out["median_ms"]["update"] == pytest.approx(2.0)
    assert out["median_ms"]["report"] == pytest.approx(0.1)
    assert out["period_ms"]["mean"] == pytest.approx(3.1)
    assert out["period_ms"]["median"] == pytest.approx(2.1)  # the median of the sums
    assert owner_summary(total, recent, 0)["steps"] == 0


def test_the_clock_keeps_a_bounded_window_of_steps():
    clock = OwnerClock()
    for _ in range(RECENT_STEPS + 5):
        clock.lap("other")
        clock.end_step()
    assert clock.steps == RECENT_STEPS + 5
    assert all(len(v) == RECENT_STEPS for v in clock.recent.values())


def test_a_segment_writes_every_owners_time_per_step_once_at_its_end(tmp_path):
    trainer, _, _, _ = segment(tmp_path, to_step=6, every=3)
    path = Path(trainer.ctx.workdir, "step_owners.json")
    trainer.train(fresh(trainer))
    out = json.loads(path.read_text())
    assert out["steps"] == len(step_lines(trainer)) == 6
    assert set(out["mean_ms"]) == set(out["median_ms"]) == set(OWNERS)
    assert all(v >= 0 for v in out["mean_ms"].values())
    assert out["mean_ms"]["forward_backward"] > 0 and out["mean_ms"]["report"] > 0
    # gapless laps: the owners' means add up to the mean loop period
    assert sum(out["mean_ms"].values()) == pytest.approx(out["period_ms"]["mean"], rel=1e-3)
    # every step line's own time is inside its iteration's period
    mean_step_ms = sum(x.step_time_s for x in step_lines(trainer)) / 6 * 1e3
    assert mean_step_ms <= out["period_ms"]["mean"]


def test_a_segment_that_runs_no_step_writes_no_owner_times(tmp_path):
    trainer, _, _, _ = segment(tmp_path, to_step=0)
    trainer.train(fresh(trainer))
    assert not Path(trainer.ctx.workdir, "step_owners.json").exists()
