"""`sweep.space` over the hyperparameters a practitioner sweeps, and `sweep.budget_fraction`:
checked when the spec is read, each error naming the field and the fix; left at their
defaults they sweep lr as before and keep every existing spec's hash."""

from __future__ import annotations

import pytest

from spec import RunSpec, SearchDim, SweepConfig
from spec.sweep import SWEPT, Budget, sweep_budget, sweep_ends
from tests.spec.helpers import demo, pinned, refused

DEMO_HASH = "c8357bb19b1b4caf"  # the demo preset's hash before these fields existed
FULL_SPACE = {"lr": {"low": 1e-3, "high": 1e-2}, "warmup_steps": {"low": 0, "high": 2,
                                                                   "log": False},
              "weight_decay": {"low": 0.0, "high": 0.2, "log": False},
              "beta2": {"low": 0.9, "high": 0.999, "log": False},
              "grad_clip": {"low": 0.25, "high": 4.0},
              "batch_tokens": {"low": 1024, "high": 4096}}


def test_an_old_spec_sweeps_lr_as_before_and_keeps_its_hash():
    spec = pinned()
    assert set(spec.sweep.space) == {"lr"} and spec.sweep.budget_fraction == 0.0
    assert spec.spec_hash() == DEMO_HASH
    assert pinned(**{"sweep.budget_fraction": 0.0}).spec_hash() == DEMO_HASH
    assert pinned(**{"sweep.budget_fraction": 0.2}).spec_hash() != DEMO_HASH


def test_every_parameter_a_practitioner_sweeps_is_accepted_with_its_range():
    spec = RunSpec.from_dict(demo(**{"sweep.space": FULL_SPACE}))
    assert set(spec.sweep.space) == set(SWEPT) == set(FULL_SPACE)
    assert spec.sweep.space["beta2"] == SearchDim(low=0.9, high=0.999, log=False)
    assert RunSpec.from_dict(spec.to_dict()) == spec  # round-trips through JSON


def test_an_unknown_parameter_is_refused_naming_the_ones_a_sweep_takes():
    err = refused(demo(**{"sweep.space": {"momentum": {"low": 0.1, "high": 0.9}}}))
    assert err.field == "sweep.space" and "momentum" in err.problem
    assert all(name in err.fix for name in SWEPT)


@pytest.mark.parametrize("space, field, words", [
    ({"beta2": {"low": 0.9, "high": 1.0, "log": False}}, "sweep.space.beta2.high", "betas"),
    ({"grad_clip": {"low": 0.0, "high": 2e6, "log": False}}, "sweep.space.grad_clip.high",
     "grad_clip"),
    ({"warmup_steps": {"low": 1.2, "high": 1.8, "log": False}}, "sweep.space.warmup_steps",
     "no whole number"),
    ({"batch_tokens": {"low": 1000, "high": 4096}}, "sweep.space.batch_tokens.low",
     "accumulation steps of 1,024"),
    ({"batch_tokens": {"low": 1024, "high": 4096 * 1024 * 64}}, "sweep.space.batch_tokens.high",
     "grad_accum"),
    ({"lr": {"low": 0.0, "high": 1e-2, "log": False}}, "sweep.space.lr.low", "lr"),
])
def test_a_range_a_trial_or_the_run_could_not_use_is_refused_naming_its_end(space, field, words):
    err = refused(demo(**{"train.min_lr": 0.0, "sweep.space": space}))
    assert err.field == field and words in f"{err.problem} {err.fix}", err


def test_the_batch_is_checked_against_every_rank_of_the_run():
    # 2 nodes x 2 ranks x 1024 tokens: the batch moves in steps of 4,096 tokens
    raw = demo(**{"train.nodes": 2, "train.procs_per_node": 2,
                  "sweep.space": {"batch_tokens": {"low": 2048, "high": 8192}}})
    err = refused(raw)
    assert err.field == "sweep.space.batch_tokens.low" and "4,096" in err.problem
    assert err.fix == "use a multiple of 4,096"
    raw["sweep"]["space"]["batch_tokens"]["low"] = 4096
    assert RunSpec.from_dict(raw).sweep.space["batch_tokens"].low == 4096


def test_the_budget_weighs_trials_times_steps_against_the_main_run_in_tokens():
    train = pinned().train  # 160 steps of 1,024 tokens
    b = sweep_budget(SweepConfig(trials=4, trial_steps=10, budget_fraction=0.2), train)
    assert (b.sweep_tokens, b.main_tokens, b.allowed_tokens) == (40_960, 163_840, 32_768.0)
    assert b.over and b.max_trial_steps == 8 and b.max_trials == 3
    assert not sweep_budget(SweepConfig(trials=4, trial_steps=8, budget_fraction=0.2),
                            train).over  # exactly at the budget fits
    assert not sweep_budget(SweepConfig(trials=4, trial_steps=10), train).over  # 0: no budget


def test_a_swept_batch_is_budgeted_at_the_top_of_its_range():
    train = pinned().train  # 160 steps of 1,024 tokens: 0.2 allows 32,768 tokens
    space = {"batch_tokens": SearchDim(low=1024, high=4096)}
    b = sweep_budget(SweepConfig(trials=2, trial_steps=5, space=space, budget_fraction=0.2),
                     train)
    assert b.trial_tokens_per_step == 4096 and b.sweep_tokens == 2 * 5 * 4096 and b.over
    assert not sweep_budget(SweepConfig(trials=2, trial_steps=5, budget_fraction=0.2),
                            train).over  # at the run's own 1,024-token batch it fits
    assert Budget(2, 4, 4096, 160, 1024, 0.2).over is False  # 32,768: exactly the budget


def test_a_spec_over_budget_is_refused_naming_both_figures_and_what_to_lower():
    err = refused(demo(**{"sweep.budget_fraction": 0.1}))  # 2 x 15 steps of a 160-step run
    assert err.field == "sweep.budget_fraction"
    assert "30,720 tokens" in err.problem and "163,840" in err.problem
    assert "18.8%" in err.problem and "allows 16,384" in err.problem
    assert "sweep.trial_steps to at most 8" in err.fix and "sweep.trials" in err.fix
    assert "raise sweep.budget_fraction" in err.fix
    assert RunSpec.from_dict(demo(**{"sweep.budget_fraction": 0.2})).sweep.budget_fraction == 0.2
    # a sweep that is off costs nothing
    assert RunSpec.from_dict(demo(**{"sweep.budget_fraction": 0.1, "sweep.enabled": False}))


def test_integer_parameters_end_in_whole_numbers():
    assert sweep_ends("batch_tokens", SearchDim(low=1024, high=4096)) == (
        ("low", 1024), ("high", 4096))
    assert sweep_ends("beta2", SearchDim(low=0.9, high=0.99, log=False)) == (
        ("low", 0.9), ("high", 0.99))


def test_auto_trial_steps_are_the_longest_trials_the_budget_allows():
    # 160 steps of 1,024 tokens: 0.2 allows 32,768 tokens, over 2 trials of 1,024 a step
    auto = pinned(**{"sweep.trial_steps": "auto", "sweep.budget_fraction": 0.2})
    assert auto.sweep.trial_steps == 16
    # the run's spec holds the number: it is the spec written with it, hash and all
    written = pinned(**{"sweep.trial_steps": 16, "sweep.budget_fraction": 0.2})
    assert auto == written and auto.spec_hash() == written.spec_hash()
    assert RunSpec.from_dict(auto.to_dict()) == auto
    assert not sweep_budget(auto.sweep, auto.train).over
    # four trials share it; a swept batch is sized at the top of its range (4,096 tokens)
    assert pinned(**{"sweep.trial_steps": "auto", "sweep.budget_fraction": 0.2,
                     "sweep.trials": 4}).sweep.trial_steps == 8
    assert pinned(**{"sweep.trial_steps": "auto", "sweep.budget_fraction": 0.2,
                     "sweep.space": {"batch_tokens": {"low": 1024, "high": 4096}}}
                  ).sweep.trial_steps == 4


def test_auto_trial_steps_without_a_budget_or_too_short_to_train_are_refused():
    err = refused(demo(**{"sweep.trial_steps": "auto"}))
    assert err.field == "sweep.trial_steps" and "budget_fraction" in err.problem
    assert "set sweep.budget_fraction" in err.fix
    err = refused(demo(**{"sweep.trial_steps": "auto", "sweep.budget_fraction": 0.005}))
    assert err.field == "sweep.trial_steps"
    assert '"auto" comes to 0 steps a trial' in err.problem and "allows" not in err.problem
    assert "163,840 tokens is 819, over 2 trials of 1,024 tokens a step" in err.problem
    assert "raise sweep.budget_fraction" in err.fix
    # pruned trials must reach their first rung: 3 rungs at factor 3 need 9 steps
    err = refused(demo(**{"sweep.trial_steps": "auto", "sweep.budget_fraction": 0.1,
                          "sweep.pruning": {"rungs": 3, "reduction_factor": 3}}))
    assert "comes to 8 steps" in err.problem and "rungs need >= 9" in err.problem
    assert "sweep.pruning.rungs" in err.fix
    for bad in ("often", 0, 2.5):
        assert refused(demo(**{"sweep.trial_steps": bad})).field == "sweep.trial_steps"
