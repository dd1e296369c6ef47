"""How a swept point becomes a trial and the main run (workflows/sweep_plan.py): each
parameter lands on its train field, the batch in whole accumulation steps of the ranks that
train it, and the winner reaches the main run as its trial had it."""

from __future__ import annotations

import pytest

from spec import preset
from workflows.sweep_plan import trial_spec, with_params

# 2 nodes x 2 ranks x 1,024 tokens x grad_accum 2: a 8,192-token global batch
RUN = {"train.nodes": 2, "train.procs_per_node": 2, "train.grad_accum": 2,
       "sweep.space": {"lr": {"low": 1e-3, "high": 1e-2},
                       "warmup_steps": {"low": 0, "high": 3, "log": False},
                       "weight_decay": {"low": 0.0, "high": 0.3, "log": False},
                       "beta2": {"low": 0.9, "high": 0.999, "log": False},
                       "grad_clip": {"low": 0.25, "high": 4.0},
                       "batch_tokens": {"low": 4096, "high": 32768}}}
POINT = {"lr": 4e-3, "warmup_steps": 2.0, "weight_decay": 0.05, "beta2": 0.98,
         "grad_clip": 0.5, "batch_tokens": 16384.0}


@pytest.mark.parametrize("name, field, expected", [
    ("lr", "lr", 4e-3), ("warmup_steps", "warmup_steps", 2),
    ("weight_decay", "weight_decay", 0.05), ("beta2", "betas", (0.9, 0.98)),
    ("grad_clip", "grad_clip", 0.5),
    # a trial runs on one node (2 ranks x 1,024 tokens a micro-step): 16,384 / 2,048
    ("batch_tokens", "grad_accum", 8)])
def test_a_trial_trains_with_each_parameter_on_its_train_field(name, field, expected):
    spec = preset("demo", **RUN)
    trial = trial_spec(spec, 3, {name: POINT[name]})
    assert getattr(trial.train, field) == expected
    untouched = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "grad_clip": 1.0,
                 "grad_accum": 4}  # grad_accum 2 x 2 nodes: the run's batch on one node
    for other, value in untouched.items():
        if other != field:
            assert getattr(trial.train, other) == value, other


def test_a_trial_is_short_on_one_node_with_every_parameter_applied_at_once():
    spec = preset("demo", **RUN)
    trial = trial_spec(spec, 1, POINT)
    t = trial.train
    assert trial.run_id == "demo-trial-1" and trial.faults == ()
    assert (t.total_steps, t.segment_steps, t.nodes) == (15, 15, 1)
    assert (t.lr, t.warmup_steps, t.weight_decay, t.betas, t.grad_clip, t.grad_accum) == (
        4e-3, 2, 0.05, (0.9, 0.98), 0.5, 8)
    assert t.micro_batch_tokens * t.world_size * t.grad_accum == 16384


def test_the_winner_reaches_the_main_run_with_the_same_values_and_global_batch():
    spec = preset("demo", **RUN)
    run = with_params(spec, POINT)
    t = run.train
    assert (t.lr, t.warmup_steps, t.weight_decay, t.betas, t.grad_clip) == (
        4e-3, 2, 0.05, (0.9, 0.98), 0.5)
    # 4 ranks x 1,024 tokens a micro-step: 16,384 tokens is grad_accum 4, as the trial's batch
    assert t.grad_accum == 4 and t.micro_batch_tokens * t.world_size * t.grad_accum == 16384
    assert (t.total_steps, t.nodes) == (spec.train.total_steps, 2)


def test_an_older_lr_only_point_builds_the_trial_it_always_did():
    spec = preset("demo")
    trial = trial_spec(spec, 0, {"lr": 5e-3})
    assert trial.train.lr == 5e-3 and trial.train.warmup_steps == 3  # min(10, 15 // 5)
    assert (trial.train.betas, trial.train.grad_accum) == (spec.train.betas, 1)
    assert with_params(spec, {"lr": 5e-3}) == spec.replace(**{"train.lr": 5e-3})


@pytest.mark.parametrize("trial_steps", [15, "auto"])
def test_a_trial_of_a_budgeted_sweep_is_a_valid_run_of_its_own(trial_steps):
    """The budget weighs the sweep against the main run; a trial, whose total_steps is one
    trial's, used to be refused by it (BadConfig naming sweep.budget_fraction)."""
    spec = preset("demo", **{"sweep.enabled": True, "sweep.trials": 2,
                             "sweep.trial_steps": trial_steps, "sweep.budget_fraction": 0.5,
                             "train.total_steps": 200})
    trial = trial_spec(spec, 0, {"lr": 2e-3})
    assert trial.train.total_steps == spec.sweep.trial_steps and trial.train.lr == 2e-3
    assert trial.sweep.budget_fraction == 0.0 and spec.sweep.budget_fraction == 0.5

