"""The full search space through the suggester and the suggest_trials activity: each
parameter's optuna distribution, every point inside every bound, the batch in whole
accumulation steps, the same points for the same records and seed, and the prior point."""

from __future__ import annotations

import math

from optuna.distributions import FloatDistribution, IntDistribution, json_to_distribution

from activities.contracts import SOURCE_PRIOR, SuggestInput, SweepObservation
from activities.suggest import suggest_trials
from spec import RunSpec, preset
from sweep.prior import prior_lr
from sweep.suggest import distribution, sweep_space

# the demo on 2 ranks: one accumulation step is 2 x 1,024 = 2,048 tokens
SPACE = {"lr": {"low": 1e-3, "high": 1e-2},
         "warmup_steps": {"low": 0, "high": 3, "log": False},
         "weight_decay": {"low": 0.01, "high": 0.3},
         "beta2": {"low": 0.9, "high": 0.999, "log": False},
         "grad_clip": {"low": 0.25, "high": 4.0},
         "batch_tokens": {"low": 2048, "high": 16384}}
UNIT = 2048


def spec() -> RunSpec:
    return preset("demo", **{"train.procs_per_node": 2, "sweep.trials": 6, "sweep.parallel": 2,
                             "sweep.space": SPACE})


def test_each_parameter_gets_its_own_optuna_distribution():
    dims = {d.name: distribution(d) for d in sweep_space(spec().sweep, UNIT)}
    assert dims["lr"] == FloatDistribution(1e-3, 1e-2, log=True)
    assert dims["weight_decay"] == FloatDistribution(0.01, 0.3, log=True)
    assert dims["beta2"] == FloatDistribution(0.9, 0.999, log=False)
    assert dims["grad_clip"] == FloatDistribution(0.25, 4.0, log=True)
    assert dims["warmup_steps"] == IntDistribution(0, 3, log=False)
    assert dims["batch_tokens"] == IntDistribution(2048, 16384, log=True)


def rounds(s: RunSpec, seed: int) -> list[dict]:
    """Three rounds through the activity, each told the last round's (made-up) losses."""
    d, observed, points = s.to_dict(), [], []
    for count in (3, 2, 1):
        out = suggest_trials(SuggestInput(d["sweep"], observed, count, seed, d))
        for p in out.points:
            loss = (math.log10(p["lr"]) + 2.5) ** 2 + p["beta2"] + p["batch_tokens"] / 1e5
            observed.append(SweepObservation(p, loss, out.distributions))
        points += out.points
    return points


def in_bounds(p: dict) -> bool:
    return (1e-3 <= p["lr"] <= 1e-2 and 0.01 <= p["weight_decay"] <= 0.3
            and 0.9 <= p["beta2"] <= 0.999 and 0.25 <= p["grad_clip"] <= 4.0
            and p["warmup_steps"] in (0, 1, 2, 3)
            and 2048 <= p["batch_tokens"] <= 16384 and p["batch_tokens"] % UNIT == 0)


def test_the_activity_keeps_every_point_inside_every_bound_the_batch_in_whole_steps():
    for sampler in ("tpe", "gp"):
        s = spec().replace(**{"sweep.sampler": sampler})
        points = rounds(s, seed=5)
        assert len(points) == 6 and all(set(p) == set(SPACE) for p in points)
        assert all(in_bounds(p) for p in points), (sampler, points)


def test_the_same_records_and_seed_give_the_same_points_and_another_seed_does_not():
    assert rounds(spec(), seed=5) == rounds(spec(), seed=5)
    assert rounds(spec(), seed=5)[1:] != rounds(spec(), seed=6)[1:]


def test_the_prior_is_step_law_lr_and_the_main_runs_own_value_of_the_rest():
    s = spec()
    d = s.to_dict()
    out = suggest_trials(SuggestInput(d["sweep"], [], 2, s.seed, d))
    first = out.points[0]
    assert out.sources[0] == SOURCE_PRIOR and first["lr"] == prior_lr(s)
    # the demo's own: weight decay 0.1, beta2 0.95, grad clip 1.0, a 2,048-token batch
    assert (first["weight_decay"], first["beta2"], first["grad_clip"]) == (0.1, 0.95, 1.0)
    assert first["batch_tokens"] == 2048.0
    assert first["warmup_steps"] == 3  # the demo's 10 steps, clipped to the range's top
    for name, text in out.distributions.items():  # the recorded point is a valid one
        assert json_to_distribution(text)._contains(
            json_to_distribution(text).to_internal_repr(first[name])), name


def test_a_space_without_lr_still_starts_at_the_main_runs_own_point():
    s = preset("demo", **{"sweep.space": {"weight_decay": {"low": 0.01, "high": 0.3}}})
    d = s.to_dict()
    out = suggest_trials(SuggestInput(d["sweep"], [], 2, s.seed, d))
    assert out.sources == [SOURCE_PRIOR, "tpe"] and out.points[0] == {"weight_decay": 0.1}
