"""`sweep.pruning`: successive halving at rung boundaries, off by default. Left at its default a
spec keeps its hash and every trial trains whole; turned on, the rung boundaries follow from
trial_steps and the reduction factor, and a spec whose trials are too short for its rungs is
refused naming the field and the fix."""

from __future__ import annotations

from spec import RunSpec
from spec.sweep import PruningConfig, rung_steps
from tests.spec.helpers import demo, pinned, refused

DEMO_HASH = "c8357bb19b1b4caf"  # the demo preset's hash before sweep.pruning existed


def test_pruning_is_off_by_default_and_keeps_every_specs_hash():
    spec = pinned()
    assert spec.sweep.pruning == PruningConfig() and not spec.sweep.pruning.enabled
    assert spec.spec_hash() == DEMO_HASH
    assert pinned(**{"sweep.pruning": {"rungs": 1}}).spec_hash() == DEMO_HASH
    on = pinned(**{"sweep.pruning": {"rungs": 2}})
    assert on.sweep.pruning.enabled and on.spec_hash() != DEMO_HASH
    assert RunSpec.from_dict(on.to_dict()) == on  # round-trips through JSON


def test_rung_boundaries_grow_by_the_reduction_factor_and_end_at_trial_steps():
    assert rung_steps(PruningConfig(), 30) == [30]  # off: one segment
    assert rung_steps(PruningConfig(rungs=3, reduction_factor=3), 30) == [3, 9, 30]
    assert rung_steps(PruningConfig(rungs=2, reduction_factor=3), 30) == [10, 30]
    assert rung_steps(PruningConfig(rungs=3, reduction_factor=2), 40) == [10, 20, 40]
    assert rung_steps(PruningConfig(rungs=4, reduction_factor=3), 15) == []  # too short


def test_trials_too_short_for_their_rungs_are_refused_naming_the_field_and_the_fix():
    err = refused(demo(**{"sweep.pruning": {"rungs": 4, "reduction_factor": 3}}))
    assert err.field == "sweep.pruning.rungs"
    assert "need trial_steps >= 27" in err.problem and "got 15" in err.problem
    assert "sweep.pruning.rungs" in err.fix and "sweep.trial_steps" in err.fix


def test_a_reduction_factor_below_two_and_an_unknown_key_are_refused():
    err = refused(demo(**{"sweep.pruning": {"rungs": 2, "reduction_factor": 1}}))
    assert err.field == "sweep.pruning.reduction_factor" and "2" in err.fix
    err = refused(demo(**{"sweep.pruning": {"rungs": 2, "min_steps": 3}}))
    assert err.field == "sweep.pruning.min_steps" and "reduction_factor" in err.fix
    err = refused(demo(**{"sweep.pruning": {"rungs": 0}}))
    assert err.field == "sweep.pruning.rungs"
