"""`train.checkpoint_every: "auto"` and its fields: "auto" or steps, the bounds
checked up front, the fields added without changing the hash of a spec that omits them."""

from __future__ import annotations

import json

import pytest

from spec import RunSpec
from tests.spec.helpers import demo as _demo
from tests.spec.helpers import refused as _error
from workflows.sweep_plan import trial_spec


def test_auto_round_trips_through_json_and_changes_the_hash():
    spec = RunSpec.from_dict(_demo(**{"train.checkpoint_every": "auto"}))
    assert spec.train.checkpoint_every == "auto" and spec.train.auto_checkpoint
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.spec_hash() == spec.spec_hash()
    assert spec.spec_hash() != RunSpec.from_dict(_demo()).spec_hash()


def test_the_new_fields_at_their_defaults_keep_the_demo_hash_and_change_it_when_set():
    demo = RunSpec.from_dict(_demo())
    assert demo.spec_hash() == "c8357bb19b1b4caf"  # measured before these fields existed
    assert (demo.train.checkpoint_every_min, demo.ops.mtbf_s, demo.ops.mtbf_prior_faults) == \
        (10, 21600.0, 3)
    for field, value in [("train.checkpoint_every_min", 5), ("ops.mtbf_s", 3600.0),
                         ("ops.mtbf_prior_faults", 1)]:
        assert demo.replace(**{field: value}).spec_hash() != demo.spec_hash(), field


@pytest.mark.parametrize("value, says", [
    ("fast", "'auto'"), ("AUTO", "'auto'"), (0, "between"), (-5, "between"),
    (2.5, "expected int"), (True, "a number"), (None, "a number")])
def test_a_bad_interval_is_refused_naming_the_field_and_the_fix(value, says):
    err = _error(_demo(**{"train.checkpoint_every": value}))
    assert err.field == "train.checkpoint_every" and says in f"{err.problem} {err.fix}", \
        (err.problem, err.fix)


def test_a_fixed_interval_longer_than_a_segment_is_still_refused():
    err = _error(_demo(**{"train.checkpoint_every": 81}))
    assert err.field == "train.checkpoint_every" and "segment" in err.problem


def test_auto_with_a_lower_bound_longer_than_a_segment_is_refused_naming_the_bound():
    err = _error(_demo(**{"train.checkpoint_every": "auto", "train.checkpoint_every_min": 81}))
    assert err.field == "train.checkpoint_every_min" and "segment" in err.problem
    ok = RunSpec.from_dict(_demo(**{"train.checkpoint_every": "auto",
                                    "train.checkpoint_every_min": 80}))
    assert ok.train.first_checkpoint_every == 80


@pytest.mark.parametrize("field, value", [
    ("ops.mtbf_s", 0.5), ("ops.mtbf_s", 400 * 86400.0), ("ops.mtbf_prior_faults", 0),
    ("train.checkpoint_every_min", 0)])
def test_the_prior_and_the_bound_are_refused_outside_their_ranges(field, value):
    assert _error(_demo(**{field: value})).field == field


def test_a_sweep_trial_of_an_auto_run_checkpoints_at_its_end_only():
    spec = RunSpec.from_dict(_demo(**{"train.checkpoint_every": "auto"}))
    trial = trial_spec(spec, 0, {"lr": 3e-3})
    assert trial.train.checkpoint_every == spec.sweep.trial_steps
