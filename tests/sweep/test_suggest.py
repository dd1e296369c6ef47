"""The sweep's Bayesian suggester (sweep/suggest.py) on known functions."""

import math

from activities.contracts import SuggestInput, SweepObservation
from activities.suggest import suggest_trials
from sweep.suggest import (
    Dim,
    expected_improvement,
    fit_best,
    from_unit,
    initial_design,
    predict,
    standardise,
    suggest,
    to_unit,
)

LR = Dim("lr", 1e-4, 1e-1, log=True)
WD = Dim("weight_decay", 0.0, 0.3)
WARMUP = Dim("warmup_steps", 0.0, 10.0, log=False, integer=True)


def bowl_1d(p: dict) -> float:
    """A quadratic bowl in log10(lr), lowest (0) at lr = 10^-2.3."""
    return (math.log10(p["lr"]) + 2.3) ** 2


def bowl_2d(p: dict) -> float:
    """A quadratic bowl in (log10(lr), weight_decay), lowest (0) at (10^-2, 0.15)."""
    return (math.log10(p["lr"]) + 2.0) ** 2 + 10.0 * (p["weight_decay"] - 0.15) ** 2


def run_rounds(space: list[Dim], f, n_init: int, per_round: int, rounds: int) -> list[float]:
    """Best loss after the initial design and after each GP round."""
    observed = [(p, f(p)) for p in initial_design(space, n_init)]
    best = [min(v for _, v in observed)]
    for _ in range(rounds):
        observed += [(p, f(p)) for p in suggest(space, observed, per_round, seed=1234)]
        best.append(min(v for _, v in observed))
    return best


def old_sweep_points(space: list[Dim], trials: int) -> list[dict]:
    """The evenly spaced diagonal design the sweep used before the suggester (verbatim)."""
    points = []
    for i in range(trials):
        frac = i / (trials - 1) if trials > 1 else 0.5
        point = {}
        for dim in space:
            if dim.log:
                point[dim.name] = dim.low * (dim.high / dim.low) ** frac
            else:
                point[dim.name] = dim.low + (dim.high - dim.low) * frac
            if dim.name == "warmup_steps":
                point[dim.name] = float(round(point[dim.name]))
        points.append(point)
    return points


def test_one_dimension_initial_design_equals_the_old_evenly_spaced_points():
    tiny = Dim("lr", 3e-3, 1e-2, log=True)  # the e2e runs' and the demo's 2-trial sweeps
    demo = Dim("lr", 1e-3, 1e-2, log=True)
    for space, n in (([tiny], 2), ([demo], 2), ([LR], 3), ([LR], 5), ([WD], 4), ([WARMUP], 4)):
        assert initial_design(space, n) == old_sweep_points(space, n)
    assert [p["warmup_steps"] for p in initial_design([WARMUP], 4)] == [0.0, 3.0, 7.0, 10.0]


def test_two_dimension_initial_design_spreads_off_the_diagonal():
    points = [to_unit([LR, WD], p) for p in initial_design([LR, WD], 3)]
    halton = [[0.5, 1 / 3], [0.25, 2 / 3], [0.75, 1 / 9]]  # bases 2 and 3, points 1..3
    assert all(math.isclose(a, b) for u, h in zip(points, halton) for a, b in zip(u, h))
    assert all(abs(u[0] - u[1]) > 0.1 for u in points)  # the diagonal moved every dim at once
    assert len({u[0] for u in points}) == 3 and len({u[1] for u in points}) == 3


def test_unit_cube_maps_log_dims_in_log_space_and_rounds_integer_dims():
    assert math.isclose(to_unit([LR], {"lr": 10 ** -2.5})[0], 0.5)
    assert math.isclose(from_unit([LR], [0.5])["lr"], 10 ** -2.5)
    assert from_unit([WARMUP], [0.43]) == {"warmup_steps": 4.0}
    assert to_unit([LR, WD], {"lr": 1.0, "weight_decay": -1.0}) == [1.0, 0.0]  # clipped


def test_gp_ei_approaches_the_optimum_of_a_1d_bowl_in_log_lr():
    best = run_rounds([LR], bowl_1d, n_init=2, per_round=1, rounds=4)
    assert best[0] > 1.6  # the two ends of the range: log10 lr = -4 and -1
    assert best[-1] < 0.02 and best[-1] < best[0] / 50, best


def test_gp_ei_batches_approach_the_optimum_of_a_2d_bowl():
    best = run_rounds([LR, WD], bowl_2d, n_init=3, per_round=2, rounds=3)
    assert best[-1] < best[0] / 4, best


def test_same_inputs_give_the_same_suggestions():
    observed = [(p, bowl_2d(p)) for p in initial_design([LR, WD], 3)]
    first = suggest([LR, WD], observed, 3, seed=7)
    assert first == suggest([LR, WD], list(observed), 3, seed=7)


def test_a_batch_of_suggestions_is_distinct_and_new():
    observed = [(p, bowl_2d(p)) for p in initial_design([LR, WD], 3)]
    batch = suggest([LR, WD], observed, 4, seed=7)
    keys = {tuple(sorted(p.items())) for p in batch}
    assert len(keys) == 4
    assert not keys & {tuple(sorted(p.items())) for p, _ in observed}


def test_diverged_trials_count_as_the_worst_loss_and_do_not_break_suggestions():
    assert standardise([1.0, 3.0, math.inf]) == standardise([1.0, 3.0, 3.0])
    assert standardise([1.0, None, math.nan, 3.0]) == standardise([1.0, 3.0, 3.0, 3.0])
    observed = [({"lr": 1e-4}, 2.0), ({"lr": 1e-1}, math.inf), ({"lr": 10 ** -2.5}, math.nan),
                ({"lr": 1e-3}, 1.0)]
    batch = suggest([LR], observed, 2, seed=7)
    assert len(batch) == 2 and all(1e-4 <= p["lr"] <= 1e-1 for p in batch)
    # every trial diverged: no finite loss at all, still two new points in range
    wrecked = suggest([LR], [({"lr": 1e-4}, math.inf), ({"lr": 1e-1}, None)], 2, seed=7)
    assert len({p["lr"] for p in wrecked}) == 2 and all(1e-4 < p["lr"] < 1e-1 for p in wrecked)


def test_expected_improvement_is_zero_at_a_sampled_point_without_noise():
    x = [[0.0], [0.3], [0.7], [1.0]]
    gp = fit_best(x, standardise([2.0, 0.5, 1.0, 3.0]), noise=0.0)
    best = min(standardise([2.0, 0.5, 1.0, 3.0]))
    at_best = expected_improvement(*predict(gp, [0.3]), best)
    between = expected_improvement(*predict(gp, [0.45]), best)
    assert at_best < 1e-4 and between > 100 * at_best


def test_integer_dimension_suggestions_are_whole_steps_not_yet_tried():
    observed = [({"warmup_steps": float(w)}, (w - 6) ** 2) for w in (0, 3, 7, 10)]
    batch = suggest([WARMUP], observed, 3, seed=7)
    assert all(p["warmup_steps"] == round(p["warmup_steps"]) for p in batch)
    assert len({p["warmup_steps"] for p in batch}) == 3
    assert not {p["warmup_steps"] for p in batch} & {0.0, 3.0, 7.0, 10.0}


def test_suggest_trials_activity_gives_the_initial_design_then_gp_points():
    sweep = {"enabled": True, "trials": 5, "parallel": 2, "trial_steps": 8,
             "space": {"weight_decay": {"low": 0.0, "high": 0.3, "log": False},
                       "lr": {"low": 1e-4, "high": 1e-1, "log": True}}}
    first = suggest_trials(SuggestInput(sweep, [], 3, 1234))
    assert first.source == "initial" and first.points == initial_design([LR, WD], 3)
    observed = [SweepObservation(p, bowl_2d(p)) for p in first.points]
    observed[1].val_loss = None  # a diverged trial travels as None
    nxt = suggest_trials(SuggestInput(sweep, observed, 2, 1234))
    assert nxt.source == "gp" and len(nxt.points) == 2
    assert nxt.points == suggest([LR, WD], [(o.params, o.val_loss) for o in observed], 2, 1234)
