import math

from ops.spec import preset
from workflows.policy import segment_bounds, sweep_points, trial_spec, with_params


def test_sweep_points_span_the_range_log_spaced():
    spec = preset("demo").replace(**{"train.min_lr": 1e-5, "sweep.trials": 3, "sweep.space": {
        "lr": {"low": 1e-4, "high": 1e-2, "log": True}}})
    lrs = [p["lr"] for p in sweep_points(spec.sweep)]
    assert math.isclose(lrs[0], 1e-4) and math.isclose(lrs[1], 1e-3) and math.isclose(lrs[2], 1e-2)


def test_trial_spec_is_a_short_faultless_run_of_its_own():
    spec = preset("demo")
    t = trial_spec(spec, 1, {"lr": 5e-3})
    assert t.run_id != spec.run_id and t.run_id.endswith("-trial-1")
    assert t.train.total_steps == spec.sweep.trial_steps and t.faults == ()
    assert t.train.lr == 5e-3 and t.train.warmup_steps < t.train.total_steps


def test_segments_cover_the_run_without_gaps():
    spec = preset("demo").replace(**{"train.total_steps": 170, "train.segment_steps": 80})
    bounds, step = [], 0
    while step < spec.train.total_steps:
        lo, hi = segment_bounds(step, spec)
        bounds.append((lo, hi))
        step = hi
    assert bounds == [(0, 80), (80, 160), (160, 170)]


def test_with_params_sets_the_swept_values():
    assert with_params(preset("demo"), {"lr": 2e-3}).train.lr == 2e-3
