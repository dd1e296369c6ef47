"""The DeepSpeed config is a pure function of the RunSpec."""

from __future__ import annotations

import pytest

from common.errors import BadConfig
from spec import RunSpec, TrainConfig
from trainer.engine import check_device, deepspeed_config, micro_batch_size, tokens_per_step


def cfg(**kw) -> TrainConfig:
    base = dict(total_steps=110, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    return TrainConfig(**{**base, **kw})


def spec(**train) -> RunSpec:
    return RunSpec(run_id="t").replace(**{f"train.{k}": v for k, v in train.items()})


def test_deepspeed_batch_sizes_come_from_tokens_seq_len_accum_and_world():
    s = spec(micro_batch_tokens=1024, grad_accum=4, procs_per_node=2)  # seq_len 128
    ds = deepspeed_config(s)
    assert micro_batch_size(s) == 8
    assert ds["train_micro_batch_size_per_gpu"] == 8
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 8 * 4 * 2
    assert tokens_per_step(s) == 1024 * 4 * 2


def test_deepspeed_optimizer_is_torch_adamw_with_spec_hyperparameters():
    ds = deepspeed_config(spec(lr=2e-3, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.05))
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 2e-3, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.05, "torch_adam": True}}


def test_deepspeed_config_has_no_scheduler_because_the_loop_sets_lr():
    assert "scheduler" not in deepspeed_config(spec())


def test_zero_stage_zero_has_no_communication_knobs():
    assert deepspeed_config(spec(zero_stage=0))["zero_optimization"] == {"stage": 0}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_and_communication_knobs_follow_spec(stage):
    zero = deepspeed_config(spec(zero_stage=stage, overlap_comm=True, contiguous_gradients=False,
                                 reduce_bucket_size=1000, allgather_bucket_size=2000)
                            )["zero_optimization"]
    assert zero == {"stage": stage, "overlap_comm": True, "contiguous_gradients": False,
                    "reduce_bucket_size": 1000, "allgather_bucket_size": 2000}


def test_zero_communication_defaults_are_contiguous_without_overlap():
    zero = deepspeed_config(spec(zero_stage=2))["zero_optimization"]
    assert zero["overlap_comm"] is False and zero["contiguous_gradients"] is True


def test_overlap_comm_at_zero_stage_zero_is_bad_config_naming_the_field():
    with pytest.raises(BadConfig) as err:
        spec(zero_stage=0, overlap_comm=True)
    assert err.value.field == "train.overlap_comm"


@pytest.mark.parametrize("precision,bf16", [("fp32", False), ("bf16", True)])
def test_deepspeed_precision_flags_follow_spec(precision, bf16):
    ds = deepspeed_config(spec(precision=precision))
    assert ds["bf16"] == {"enabled": bf16}
    assert ds["fp16"] == {"enabled": False}


def test_fp16_uses_dynamic_loss_scaling_with_spec_window_hysteresis_and_floor():
    ds = deepspeed_config(spec(precision="fp16", fp16_initial_scale_power=12,
                               fp16_loss_scale_window=200, fp16_hysteresis=3,
                               fp16_min_loss_scale=0.5))
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                          "loss_scale_window": 200, "hysteresis": 3, "min_loss_scale": 0.5}
    assert ds["bf16"] == {"enabled": False}


def test_fp16_min_scale_above_initial_scale_is_bad_config():
    with pytest.raises(BadConfig) as err:
        spec(fp16_initial_scale_power=2, fp16_min_loss_scale=8.0)
    assert err.value.field == "train.fp16_min_loss_scale"


def test_fp16_on_cpu_is_bad_config_naming_precision_and_cuda_allows_it():
    with pytest.raises(BadConfig) as err:
        check_device(spec(precision="fp16"), cuda=False)
    assert err.value.field == "train.precision" and "bf16" in err.value.fix
    check_device(spec(precision="fp16"), cuda=True)
    check_device(spec(precision="bf16"), cuda=False)


@pytest.mark.parametrize("accum", [1, 3])
def test_gradient_accumulation_follows_spec(accum):
    assert deepspeed_config(spec(grad_accum=accum))["gradient_accumulation_steps"] == accum


def test_deepspeed_gradient_clipping_and_quiet_printing():
    ds = deepspeed_config(spec(grad_clip=0.5))
    assert ds["gradient_clipping"] == 0.5
    assert deepspeed_config(spec(grad_clip=0.0))["gradient_clipping"] == 0.0  # 0 = off
    assert ds["steps_per_print"] >= 1 << 30
