import json

import pytest

from ops.errors import BadConfig
from ops.spec import PRESETS, RunSpec, preset


def _error(raw) -> BadConfig:
    with pytest.raises(BadConfig) as info:
        RunSpec.from_dict(raw)
    return info.value


def test_spec_round_trips_through_json_unchanged():
    spec = preset("demo")
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_unknown_field_is_named_with_its_path():
    err = _error({"run_id": "r", "train": {"total_step": 5}})
    assert err.field == "train.total_step"
    assert "total_steps" in err.fix  # the known fields are listed as the fix


def test_negative_steps_are_rejected_naming_the_field():
    err = _error({"run_id": "r", "train": {"total_steps": -5}})
    assert err.field == "train.total_steps" and "> 0" in err.problem


def test_nested_section_errors_carry_the_full_path():
    assert _error({"run_id": "r", "data": {"cleaning": {"min_chars": 0}}}).field == \
        "data.cleaning.min_chars"


def test_wrong_types_are_rejected_not_coerced():
    assert _error({"run_id": "r", "train": {"total_steps": "100"}}).field == "train.total_steps"
    assert _error({"run_id": "r", "sweep": {"enabled": 1}}).field == "sweep.enabled"


def test_run_id_must_be_a_safe_storage_path_component():
    assert _error({"run_id": "../etc"}).field == "run_id"
    assert _error({"run_id": "A"}).field == "run_id"


def test_cross_field_rules_name_the_field_to_change():
    err = _error({"run_id": "r", "train": {"micro_batch_tokens": 1000}})
    assert err.field == "train.micro_batch_tokens" and "seq_len" in err.problem


def test_replace_applies_dotted_overrides_and_revalidates():
    spec = preset("demo").replace(**{"train.lr": 1e-3, "run_id": "other"})
    assert spec.train.lr == 1e-3 and spec.run_id == "other"
    with pytest.raises(BadConfig):
        spec.replace(**{"train.lr": -1.0})


def test_spec_hash_changes_with_any_field():
    spec = preset("demo")
    assert spec.spec_hash() != spec.replace(**{"seed": spec.seed + 1}).spec_hash()


def test_demo_preset_injects_a_worker_kill():
    assert PRESETS["demo"]["faults"][0]["kind"] == "kill_worker"


def test_sweep_below_min_lr_is_rejected_before_any_trial_runs():
    err = _error({"run_id": "r", "train": {"min_lr": 1e-3},
                  "sweep": {"space": {"lr": {"low": 1e-4, "high": 1e-2}}}})
    assert err.field == "sweep.space.lr.low"
