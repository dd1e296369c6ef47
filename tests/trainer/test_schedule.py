"""The LR of every step: the base schedule, the workflow's windows and one-shot bursts, all
on one convention — the 1-based step being run."""

from __future__ import annotations

import math

import pytest

from spec import TrainConfig
from trainer.schedule import LRSchedule, lr_at, lr_scale


def cfg(**kw) -> TrainConfig:
    base = dict(total_steps=110, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    return TrainConfig(**{**base, **kw})


def test_lr_warms_up_linearly_then_decays_to_min_lr():
    c = cfg()
    assert lr_at(1, c) == pytest.approx(1e-4)
    assert lr_at(5, c) == pytest.approx(5e-4)
    assert lr_at(10, c) == pytest.approx(1e-3)
    assert lr_at(11, c) == pytest.approx(1e-3)  # cosine starts at its peak
    assert lr_at(61, c) == pytest.approx(5.5e-4)  # half way: midpoint of lr and min_lr
    assert lr_at(111, c) == pytest.approx(1e-4)
    decay = [lr_at(s, c) for s in range(11, 112)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_lr_stays_at_min_lr_past_total_steps():
    assert lr_at(112, cfg()) == pytest.approx(1e-4)
    assert lr_at(10_001, cfg()) == pytest.approx(1e-4)


def test_lr_without_warmup_starts_at_peak():
    assert lr_at(1, cfg(warmup_steps=0)) == pytest.approx(1e-3)


def test_lr_follows_the_cosine_formula_between_warmup_and_total():
    c = cfg()
    expected = 1e-4 + 0.5 * (1 + math.cos(math.pi * 25 / 100)) * 9e-4
    assert lr_at(36, c) == pytest.approx(expected)


def test_step_one_runs_at_the_first_warmup_lr_not_at_zero():
    c = cfg()
    assert lr_at(1, c) == pytest.approx(c.lr / c.warmup_steps)
    assert lr_at(c.warmup_steps, c) == pytest.approx(c.lr)


def test_windows_multiply_the_lr_of_the_steps_they_hold_start_exclusive():
    windows = [[10, 20, 0.5], [15, 30, 0.5]]
    assert [lr_scale(windows, s) for s in (10, 11, 15, 16, 20, 21, 30, 31)] == \
        [1.0, 0.5, 0.5, 0.25, 0.25, 0.5, 0.5, 1.0]


def test_the_schedule_is_the_base_lr_times_the_windows():
    c = cfg()
    schedule = LRSchedule(c, [[10, 20, 0.5]])
    assert [schedule(s) for s in (10, 11, 20, 21)] == \
        [lr_at(10, c), lr_at(11, c) * 0.5, lr_at(20, c) * 0.5, lr_at(21, c)]


def test_a_one_shot_window_applies_the_first_time_its_steps_run_only():
    c = cfg()
    schedule = LRSchedule(c, [], one_shot=[[2, 4, 10.0]])  # steps 3 and 4, like lr_burst
    first = [schedule(s) for s in (1, 2, 3, 4, 5)]
    assert first == [lr_at(s, c) * (10.0 if s in (3, 4) else 1.0) for s in (1, 2, 3, 4, 5)]
    replay = [schedule(s) for s in (3, 4, 5, 6)]  # after a rollback to step 2
    assert replay == [lr_at(s, c) for s in (3, 4, 5, 6)]
