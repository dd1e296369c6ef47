"""Every numeric field of the run spec has a documented bound (spec/codec.py `num`): at the
bound it is accepted, one past it refused naming the field, and each answer comes within a
second - "auto" layouts and sweeps included, whose searches are bounded too."""

from __future__ import annotations

import math
import time

import pytest

from common.errors import BadConfig
from common.limits import MAX_BATCH_TOKENS
from spec import RunSpec, SearchDim
from spec.codec import build
from spec.layout import divisors
from tests.spec.bounds_walk import ends, numeric_fields, with_value
from tests.spec.helpers import demo

SECOND = 1.0  # generous: each call takes milliseconds; hours is what this guards against

# What else a field's bound needs to be a valid spec (a cross-field rule), by path.
HEADS_1024 = {"model.d_model": 2048, "model.n_heads": 1024, "model.n_kv_heads": 1024}
CONTEXT: dict[str, dict] = {
    "data.cleaning.min_chars": {"data.cleaning.max_chars": 10**9},
    "data.cleaning.max_chars": {"data.cleaning.min_chars": 1},
    "model.d_model": {"model.n_heads": 1, "model.n_kv_heads": 1},
    "model.n_heads": {"model.d_model": 2048, "model.n_kv_heads": 1},
    "model.n_kv_heads": HEADS_1024,
    "model.seq_len": {"train.micro_batch_tokens": 1 << 20},
    "train.total_steps": {"train.warmup_steps": 0, "train.segment_steps": 1,
                          "train.checkpoint_every": 1},
    "train.segment_steps": {"train.checkpoint_every": 1},
    "train.micro_batch_tokens": {"model.seq_len": 1},
    "train.min_lr": {"train.lr": 10.0},
    "train.lr": {"train.min_lr": 0.0},
    "train.warmup_steps": {"train.total_steps": 10**12},
    "train.min_nodes": {"train.nodes": 4096},
    "train.checkpoint_every": {"train.total_steps": 10**12, "train.segment_steps": 10**12},
    "train.checkpoint_every_min": {"train.checkpoint_every": "auto", "train.total_steps": 10**12,
                                   "train.segment_steps": 10**12},
    "train.fp16_min_loss_scale": {"train.fp16_initial_scale_power": 32},
    "train.fp16_initial_scale_power": {"train.fp16_min_loss_scale": 1e-9},
    "train.eval_every": {},
    "train.layout.tp": {**HEADS_1024, "train.procs_per_node": 1024},
    "train.layout.pp": {"model.n_layers": 1024, "train.nodes": 1024, "train.grad_accum": 1024},
    "sweep.trials": {"sweep.enabled": False},
    "sweep.pruning.rungs": {"sweep.trial_steps": 1 << 15, "sweep.pruning.reduction_factor": 2},
    "sweep.pruning.reduction_factor": {"sweep.trial_steps": 100},
    "storage.upload_retry_s": {"storage.upload_retry_max_s": 3600.0},
    "storage.upload_retry_max_s": {"storage.upload_retry_s": 0.1},
    "spikes.window": {"spikes.patience": 1},
    "spikes.patience": {"spikes.window": 10**6},
    "spikes.return_threshold": {"spikes.skip_threshold": 1e6},
    "spikes.skip_threshold": {"spikes.return_threshold": math.nextafter(0.0, 1.0)},
    "faults[0].rank": {"train.nodes": 4096, "train.procs_per_node": 1024},
    "distill.student.d_model": {"distill.student.n_heads": 1, "distill.student.n_kv_heads": 1},
    "distill.student.n_heads": {"distill.student.d_model": 2048,
                                "distill.student.n_kv_heads": 1},
    "distill.student.n_kv_heads": {"distill.student.d_model": 2048,
                                   "distill.student.n_heads": 1024,
                                   "distill.student.n_kv_heads": 1024},
}
# A field whose bound another field must equal, set along with it.
FOLLOWS = {"train.layout.zero": "train.zero_stage"}
FIELDS = [nf for nf in numeric_fields(RunSpec) if not nf.path.startswith("sweep.space.")]
ABSURD = (1e300, -1e300, math.inf, -math.inf, math.nan)


def _base(path: str) -> dict:
    over = {"sweep.enabled": path.startswith("sweep."), **CONTEXT.get(path, {})}
    if path.startswith("train.layout."):
        over["train.layout"] = {"tp": 1, "pp": 1, "zero": 0}
    return demo(**over)


def _spec(nf, base: dict, value: float) -> dict:
    """`base` with the field at `value` (a tuple field: every item), and any field that
    must follow it."""
    raw = with_value(base, nf.path, [value] * nf.items if nf.items else value)
    follower = FOLLOWS.get(nf.path)
    return with_value(raw, follower, value) if follower and 0 <= value <= 3 else raw


def _timed(raw: dict) -> tuple[BadConfig | None, float]:
    start = time.monotonic()
    try:
        RunSpec.from_dict(raw)
        err = None
    except BadConfig as exc:
        err = exc
    return err, time.monotonic() - start


def test_the_walk_finds_every_numeric_section_of_the_spec():
    paths = {nf.path for nf in numeric_fields(RunSpec)}
    assert len(paths) > 120
    for path in ("seed", "train.lr", "train.betas", "train.layout.tp", "faults[0].at_step",
                 "sweep.space.lr.low", "distill.temperature", "distill.student.seq_len",
                 "spikes.oscillation.ratio", "train.cluster.memory_gb", "ops.mtbf_s"):
        assert path in paths


@pytest.mark.parametrize("nf", FIELDS, ids=lambda nf: nf.path)
def test_each_field_is_accepted_at_its_bound_and_refused_past_it_naming_it(nf):
    base = _base(nf.path)
    for label, value, accepted in ends(nf):
        err, took = _timed(_spec(nf, base, value))
        assert took < SECOND, (nf.path, label, took)
        if accepted:
            assert err is None, (nf.path, label, value, err)
        else:
            assert err is not None and err.field.startswith(nf.path), (nf.path, label, err)


@pytest.mark.parametrize("nf", FIELDS, ids=lambda nf: nf.path)
def test_absurd_numbers_are_refused_naming_the_field(nf):
    base = _base(nf.path)
    for value in ABSURD:
        err, took = _timed(_spec(nf, base, value))
        assert took < SECOND and err is not None and err.field.startswith(nf.path), \
            (nf.path, value, err)


def test_a_swept_dimension_is_bounded_at_both_ends():
    # every name's own bound is its train field's (checked above through each trial); the
    # dimension's own fence is [0, STEPS), (0, STEPS]
    top = 10**12
    assert build(SearchDim, {"low": math.nextafter(top, 0), "high": top, "log": False}, "d")
    for raw, field in (({"low": top, "high": top}, "d.low"),
                       ({"low": 1.0, "high": math.nextafter(top, math.inf)}, "d.high"),
                       ({"low": 1e300, "high": 2e300}, "d.low"),
                       ({"low": 0.0, "high": 0.0, "log": False}, "d.high")):
        with pytest.raises(BadConfig) as info:
            build(SearchDim, raw, "d")
        assert info.value.field == field


def test_auto_layout_with_a_batch_past_the_planners_bound_is_refused_within_a_second():
    # 2^30-token micro-batches x 2^16 accumulations: each in range; the divisor search over
    # 2^46 sequences ran for hours
    err, took = _timed(demo(**{"train.layout": "auto", "model.seq_len": 1024,
                               "train.micro_batch_tokens": 1 << 30, "train.grad_accum": 1 << 16,
                               "sweep.enabled": False}))
    assert took < SECOND
    assert err is not None and err.field == "train.micro_batch_tokens"
    assert f"{MAX_BATCH_TOKENS:,}" in err.problem


def test_auto_layout_at_the_planners_batch_bound_plans_within_a_second():
    # one-token sequences: 2^36 of them on one rank, the most the micro-batch search sees
    err, took = _timed(demo(**{"train.layout": "auto", "model.seq_len": 1,
                               "train.micro_batch_tokens": 1 << 30, "train.grad_accum": 64,
                               "train.cluster": {"memory_gb": 1e6}, "sweep.enabled": False}))
    assert err is None and took < SECOND


@pytest.mark.parametrize("nf", [nf for nf in FIELDS if nf.path.startswith(("train.", "model."))
                                and not nf.path.startswith("train.layout.")],
                         ids=lambda nf: nf.path)
def test_auto_layout_at_every_train_and_model_bound_answers_within_a_second(nf):
    base = with_value(_base(nf.path), "train.layout", "auto")
    for _, value, _ in ends(nf):
        _, took = _timed(_spec(nf, base, value))
        assert took < SECOND, (nf.path, value, took)


def test_divisors_are_every_divisor_in_order_found_in_square_root_time():
    assert divisors(1) == [1]
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(97) == [1, 97]
    start = time.monotonic()
    assert divisors(MAX_BATCH_TOKENS) == [2**k for k in range(37)]
    assert divisors(MAX_BATCH_TOKENS - 5)[-1] == MAX_BATCH_TOKENS - 5
    assert time.monotonic() - start < SECOND


@pytest.mark.parametrize("over, field", [
    ({"sweep.sampler": "nope"}, "sweep.sampler"),
    ({"sweep.space": {"nope": {"low": 1, "high": 2}}}, "sweep.space"),
    ({"sweep.trials": 1}, "sweep.trials"),
    ({"sweep.space": {"warmup_steps": {"low": 1.2, "high": 1.8}}}, "sweep.space.warmup_steps")])
def test_with_auto_trial_steps_a_sweep_refusal_names_the_sweep_field(over, field):
    err, _ = _timed(demo(**{"sweep.trial_steps": "auto", "sweep.budget_fraction": 0.5, **over}))
    assert err is not None and err.field == field


@pytest.mark.parametrize("extra", [{"train.nodes": 4, "train.min_nodes": 2},
                                   {"train.init_from": "base-run"}])
def test_auto_layout_plans_no_zero_3_where_the_run_could_not_use_it(extra):
    # states that fit half of 5 MB only at ZeRO 3: elastic nodes and init_from cannot
    # use a ZeRO-3 checkpoint, so "auto" finds no layout and says so as train.layout
    err, took = _timed(demo(**{"train.layout": "auto", "sweep.enabled": False,
                               "train.micro_batch_tokens": 128,
                               "model.activation_checkpointing": True,
                               "train.cluster": {"memory_gb": 0.005}, **extra}))
    assert took < SECOND
    assert err is not None and err.field == "train.layout", err
