"""benchmarks/overhead.py's pure parts: the loop periods of a progress file, the launches'
per-owner step times merged, and the itemised remainder over the plain loop."""

from __future__ import annotations

import pytest

from benchmarks.overhead import itemise, loop_periods, merged_owners
from trainer.step_metrics import OWNERS


def test_loop_periods_are_between_consecutive_steps_of_one_launch_only():
    steps = [{"step": 1, "ts": 10.0}, {"step": 2, "ts": 10.1}, {"step": 3, "ts": 10.3},
             {"step": 2, "ts": 11.0}, {"step": 3, "ts": 11.2}]  # a rollback replays step 2
    assert loop_periods(steps) == pytest.approx([0.1, 0.2, 0.2])


def owners(steps: int, ms: float, **more: float) -> dict:
    med = {**dict.fromkeys(OWNERS, 0.0), **more}
    return {"steps": steps, "median_ms": med, "mean_ms": {o: v + ms for o, v in med.items()}}


def test_launches_are_merged_weighted_by_their_steps():
    merged = merged_owners([owners(100, 0.0, report=0.1), owners(300, 0.0, report=0.3),
                            {"steps": 0}])
    assert merged["steps"] == 400
    assert merged["median_ms"]["report"] == pytest.approx(0.25)
    assert merged_owners([])["steps"] == 0


def test_the_itemised_remainder_adds_up_to_the_period_minus_the_plain_step():
    own = merged_owners([owners(10, 0.0, probe=0.2, report=0.1, judge=0.15, other=0.05,
                                loss_and_stop=0.1, checkpoints=0.01, forward_backward=100.0,
                                update=3.0)])
    items = itemise(plain_s=0.100, bare_s=0.102, period_s=0.1045, owners=own)
    assert items["remainder"] == pytest.approx(4.5)
    assert items["engine"] == pytest.approx(2.0)
    assert items["probes"] == pytest.approx(0.2) and items["progress"] == pytest.approx(0.1)
    assert items["spike_judge"] == pytest.approx(0.15)
    assert items["train_step_other"] == pytest.approx(0.05)
    assert items["loop_owners"] == pytest.approx(0.01)
    assert items["compute_vs_bare"] == pytest.approx(1.0)
    parts = sum(v for k, v in items.items() if k not in ("remainder", "unexplained"))
    assert parts + items["unexplained"] == pytest.approx(items["remainder"])
