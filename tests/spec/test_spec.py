import dataclasses
import json
import math
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spec as spec_module
from common.errors import BadConfig
from spec import PRESETS, RunSpec
from tests.spec.helpers import demo, pinned
from workflows.activity_options import segment_options, short_options
from workflows.sweep_plan import sweep_rounds, trial_spec, with_params


def _error(raw) -> BadConfig:
    with pytest.raises(BadConfig) as info:
        RunSpec.from_dict(raw)
    return info.value


def test_spec_round_trips_through_json_unchanged():
    spec = pinned()
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_unknown_field_is_named_with_its_path():
    err = _error({"run_id": "r", "train": {"total_step": 5}})
    assert err.field == "train.total_step"
    assert "total_steps" in err.fix  # the known fields are listed as the fix


def test_negative_steps_are_rejected_naming_the_field():
    err = _error({"run_id": "r", "train": {"total_steps": -5}})
    assert err.field == "train.total_steps" and "must be in [1, " in err.problem


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
    spec = pinned().replace(**{"train.lr": 1e-3, "run_id": "other"})
    assert spec.train.lr == 1e-3 and spec.run_id == "other"
    with pytest.raises(BadConfig):
        spec.replace(**{"train.lr": -1.0})


@pytest.mark.parametrize("field, value", [
    ("seed", 1235), ("data.corpus", "stdlib:json/*.py"), ("data.dedup.threshold", 0.7),
    ("data.cleaning.min_chars", 65), ("model.d_model", 256), ("train.lr", 0.002),
    ("train.betas", [0.9, 0.99]), ("sweep.trials", 3), ("storage.keep_last", 2),
    ("spikes.budget.rollbacks", 4), ("ops.heartbeat_timeout_s", 11.0), ("faults", [])])
def test_spec_hash_changes_with_any_field(field, value):
    spec = pinned()
    assert spec.spec_hash() != spec.replace(**{field: value}).spec_hash()


def test_demo_preset_injects_a_worker_kill():
    assert PRESETS["demo"]["faults"][0]["kind"] == "kill_worker"


def test_sweep_below_min_lr_is_rejected_before_any_trial_runs():
    err = _error({"run_id": "r", "train": {"min_lr": 1e-3},
                  "sweep": {"space": {"lr": {"low": 1e-4, "high": 1e-2}}}})
    assert err.field == "sweep.space.lr.low"


# ---- every number finite and bounded, cross-field rules up front ---------------------------


def _demo(**dotted) -> dict:
    return demo(**dotted)


@pytest.mark.parametrize("value", [1e20, 1e10, math.inf])
def test_segment_budget_must_be_a_finite_bounded_number(value):
    err = _error(_demo(**{"ops.segment_budget_s": value}))
    assert err.field == "ops.segment_budget_s"


def test_infinity_and_nan_from_json_text_are_refused_naming_the_field():
    raw = json.loads('{"run_id": "r", "train": {"lr": NaN}, "ops": {"hang_timeout_s": Infinity}}')
    assert _error(raw).field == "train.lr"
    raw["train"]["lr"] = 1e-3
    assert "finite" in _error(raw).problem


def test_integers_too_large_for_any_float_are_bad_config_not_overflow():
    assert _error(_demo(**{"train.lr": 10**400})).field == "train.lr"
    assert _error(_demo(**{"train.total_steps": 10**400})).field == "train.total_steps"


@pytest.mark.parametrize("field,value", [
    ("model.d_model", 10**9), ("model.seq_len", 1 << 24), ("train.total_steps", 10**13),
    ("train.micro_batch_tokens", 1 << 40), ("train.lr", 11.0), ("train.segments_per_run", 10**6),
    ("ops.heartbeat_timeout_s", 2 * 86400.0), ("ops.heartbeat_timeout_s", 1e-9),
    ("storage.keep_last", 10**9), ("sweep.trials", 5000)])
def test_absurd_sizes_are_refused_before_any_gpu_is_used(field, value):
    assert _error(_demo(**{field: value})).field == field


# spec_hash of the demo preset with run_id "hash-pin" before metrics_port was removed (8350b22)
HASH_BEFORE_REMOVAL = "110ac9f4598b1d51"


def test_the_removed_metrics_port_is_ignored_on_input_and_changes_no_hash():
    # it was ignored (a Prometheus port belongs to a worker: `mainspring worker --metrics-port`)
    old = RunSpec.from_dict(_demo(**{"ops.metrics_port": 9100}))  # a stored spec, a run in flight
    assert "metrics_port" not in old.to_dict()["ops"]
    assert old == RunSpec.from_dict(_demo())
    # (as stored then: with that time's hang_timeout_s default, explicit in a stored spec;
    # the fields added since, at their defaults, leave the hash alone: OpsConfig.ADDED)
    stored = pinned(run_id="hash-pin", **{"ops.hang_timeout_s": 600.0})
    assert stored.spec_hash() == HASH_BEFORE_REMOVAL
    assert stored.replace(**{"ops.repeat_failure_limit": 4}).spec_hash() != HASH_BEFORE_REMOVAL
    err = _error(_demo(**{"ops.metrics_prt": 0}))  # an unknown field is still refused
    assert err.field == "ops.metrics_prt" and err.problem == "unknown field"
    assert err.fix.startswith("remove it; known fields here: ") and "metrics_every" in err.fix


def test_a_fault_factor_and_attempt_are_bounded():
    assert _error(_demo(faults=[{"kind": "lr_burst", "at_step": 5, "factor": 1e300}])).field \
        == "faults[0].factor"
    assert _error(_demo(faults=[{"kind": "kill_worker", "at_step": 5, "attempt": 0}])).field \
        == "faults[0].attempt"


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64 + 5])
def test_seed_is_non_negative_and_fits_64_bits(seed):
    assert _error(_demo(seed=seed)).field == "seed"
    assert RunSpec.from_dict(_demo(seed=2**63 - 1)).seed == 2**63 - 1


def test_run_id_with_a_trailing_newline_is_refused():
    assert _error(_demo(run_id="demo\n")).field == "run_id"  # re.match with $ accepted it


def test_strings_with_control_characters_or_absurd_length_are_refused():
    assert _error(_demo(**{"data.text_field": "te\x00xt"})).field == "data.text_field"
    assert _error(_demo(**{"data.corpus": "/data/" + "x" * 5000})).field == "data.corpus"
    assert _error(_demo(**{"data.text_field": ""})).field == "data.text_field"


def test_every_numeric_field_declares_a_range_and_its_default_lies_in_it():
    from spec.codec import value_range

    sections = [getattr(spec_module, n) for n in spec_module.__all__
                if dataclasses.is_dataclass(getattr(spec_module, n))]
    assert len(sections) == 15
    for section in sections:
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            tp = hints[f.name]
            numeric = tp in (int, float) or (typing.get_origin(tp) is tuple and all(
                a in (int, float) for a in typing.get_args(tp)))
            if not numeric:
                continue
            rng = value_range(f)
            assert rng is not None, f"{section.__name__}.{f.name} has no documented range"
            if f.default is not dataclasses.MISSING:
                values = f.default if isinstance(f.default, tuple) else (f.default,)
                assert all(rng[0] <= v <= rng[1] for v in values), (section.__name__, f.name)


def test_sweep_warmup_above_trial_steps_is_refused_at_validation():
    err = _error(_demo(**{"sweep.trial_steps": 15, "sweep.space": {
        "warmup_steps": {"low": 1, "high": 20, "log": False}}}))
    assert err.field == "sweep.space.warmup_steps.high" and "trial" in err.problem


def test_sweep_warmup_valid_for_trials_but_not_for_the_training_run_is_refused():
    err = _error(_demo(**{"train.total_steps": 20, "train.segment_steps": 20,
                          "train.checkpoint_every": 10, "sweep.trial_steps": 40,
                          "sweep.space": {"warmup_steps": {"low": 1, "high": 30, "log": False}}}))
    assert err.field == "sweep.space.warmup_steps.high" and "training" in err.problem


def test_sweep_warmup_that_rounds_past_the_trial_length_is_refused():
    # the suggester rounds warmup_steps to whole steps: 14.6 becomes 15 = trial_steps
    err = _error(_demo(**{"sweep.trial_steps": 15, "sweep.space": {
        "warmup_steps": {"low": 1, "high": 14.6, "log": False}}}))
    assert err.field == "sweep.space.warmup_steps.high"


@pytest.mark.parametrize("space,field", [
    ({"lr": {"low": 1e-3, "high": 50.0}}, "sweep.space.lr.high"),
    ({"weight_decay": {"low": -0.5, "high": 0.1, "log": False}}, "sweep.space.weight_decay.low"),
    ({"weight_decay": {"low": 0.0, "high": 20.0, "log": False}}, "sweep.space.weight_decay.high"),
    ({"lr": {"low": 1e-300, "high": 1e-2}}, "sweep.space.lr.low")])
def test_sweep_ranges_a_trial_could_not_use_are_refused_naming_the_end(space, field):
    assert _error(_demo(**{"train.min_lr": 0.0, "sweep.space": space})).field == field


# Worst values for any field: wrong types, huge and non-finite numbers, bad strings and URLs.
WORST = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 10**12, 10**13, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e20, 1e308, 5e-324, -0.0]),
    st.text(max_size=12),
    st.sampled_from(["", "   ", "demo\n", "s3://", "s3:///x", "nosuch://x", "http://h/x",
                     "s3://u:p@bucket/x", "s3://Bad_Bucket", "file://host/x", "a::b", "stdlib:",
                     "memory://", "x" * 5000]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(),
                                                         max_size=2))
SWEEP_SPACE = {"lr": {"low": 1e-3, "high": 1e-2, "log": True},
               "weight_decay": {"low": 0.0, "high": 0.2, "log": False},
               "warmup_steps": {"low": 0, "high": 2, "log": False}}


def _leaves(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*prefix, k))
    else:
        yield prefix


def _set(raw, path, value):
    node = raw
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def _full_demo() -> dict:
    raw = RunSpec.from_dict(_demo(**{"sweep.space": SWEEP_SPACE, "sweep.trials": 4})).to_dict()
    raw["faults"] = {"0": {"kind": "lr_burst", "at_step": 5, "steps": 2, "factor": 3.0}}
    return raw


LEAVES = [p for p in _leaves(_full_demo())]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(LEAVES), WORST), min_size=1, max_size=3))
def test_any_field_at_its_worst_is_bad_config_naming_it_or_a_spec_the_workflow_can_use(changes):
    raw = _full_demo()
    for path, value in changes:
        _set(raw, path, value)
    raw["faults"] = list(raw["faults"].values())
    try:
        spec = RunSpec.from_dict(raw)
    except BadConfig as err:
        root = err.field.split(".")[0].split("[")[0]
        assert root in {f.name for f in dataclasses.fields(RunSpec)}, err.field
        return
    # everything the workflows derive from a valid spec works (workflows/policy.py)
    segment_options(spec)
    short_options(spec)
    assert sum(sweep_rounds(spec.sweep)) == spec.sweep.trials
    json.dumps(spec.to_dict(), allow_nan=False)
    if spec.sweep.enabled:
        ends = [{k: d.low for k, d in spec.sweep.space.items()},
                {k: d.high for k, d in spec.sweep.space.items()}]
        for i, p in enumerate(ends):
            segment_options(trial_spec(spec, i, p))
            with_params(spec, p)


def test_more_nodes_than_any_cluster_is_bad_config_naming_the_limit():
    err = _error({"run_id": "r", "train": {"nodes": 5000}})
    assert err.field == "train.nodes" and "larger than any cluster" in str(err)
    assert "4096" in err.fix


@pytest.mark.parametrize("train, words", [
    ({"nodes": 4, "min_nodes": 3}, "does not divide"),
    ({"nodes": 2, "min_nodes": 3}, "must be <= nodes"),
    ({"nodes": 2, "min_nodes": 1, "zero_stage": 3}, "ZeRO-3"),
])
def test_an_elastic_setting_the_run_cannot_keep_is_bad_config_naming_min_nodes(train, words):
    err = _error({"run_id": "r", "train": train})
    assert err.field == "train.min_nodes" and words in str(err), err


def test_a_trial_of_a_multinode_run_runs_on_one_node_with_the_run_s_global_batch():
    s = RunSpec.from_dict({"run_id": "r", "train": {"nodes": 4, "min_nodes": 2,
                                                    "procs_per_node": 2, "grad_accum": 2}})
    t = trial_spec(s, 0, {"lr": 1e-3}).train
    assert (t.nodes, t.min_nodes, t.world_size * t.grad_accum) == (1, 0, 16)


def test_new_multinode_fields_at_their_defaults_keep_the_spec_hash():
    # the demo preset's hash before the multi-node fields (measured at d358520)
    assert pinned().spec_hash() == "c8357bb19b1b4caf"
    stored = pinned(run_id="hash-pin", **{"ops.hang_timeout_s": 600.0})
    assert stored.spec_hash() == HASH_BEFORE_REMOVAL
    for changed in ({"train.min_nodes": 1}, {"ops.node_wait_s": 60.0},
                    {"ops.node_failure_limit": 3}):
        assert stored.replace(**changed).spec_hash() != HASH_BEFORE_REMOVAL, changed
