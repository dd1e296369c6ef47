"""The learning-rate schedule and the DeepSpeed config, both pure functions of the RunSpec.

No DeepSpeed scheduler: the step loop sets the LR from `lr_at(step)` before every optimizer
step, so the schedule is a function of the (checkpointed) step alone and resume cannot
drift from it.
"""

from __future__ import annotations

import math
from typing import Any

from ops.spec import RunSpec, TrainConfig

# DeepSpeed prints a summary every `steps_per_print` steps; the progress file already has it.
QUIET_STEPS = 1 << 30


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for the optimizer step that turns `step` into `step + 1`.

    Linear warmup from lr/warmup to lr over `warmup_steps`, then cosine decay to `min_lr`
    at `total_steps`, flat at `min_lr` afterwards (nanoGPT's `get_lr`).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.total_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def micro_batch_size(spec: RunSpec) -> int:
    """Sequences per rank per micro-batch."""
    return spec.train.micro_batch_tokens // spec.model.seq_len


def tokens_per_step(spec: RunSpec) -> int:
    t = spec.train
    return t.micro_batch_tokens * t.grad_accum * t.world_size


def deepspeed_config(spec: RunSpec) -> dict[str, Any]:
    t = spec.train
    mbs = micro_batch_size(spec)
    return {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": mbs * t.grad_accum * t.world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16"},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "betas": list(t.betas),
                "eps": t.eps,
                "weight_decay": t.weight_decay,
                # DESIGN §5: DeepSpeed's default FusedAdam does not resume bitwise exactly
                # on CPU; torch.optim.AdamW does (ZeRO 0 and 2, world size 1 and 2).
                "torch_adam": True,
            },
        },
        "steps_per_print": QUIET_STEPS,
        "wall_clock_breakdown": False,
    }


def build_engine(spec: RunSpec, model):
    """deepspeed.initialize with the derived config; decay/no-decay parameter groups."""
    import deepspeed

    from trainer.model import param_groups

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, spec.train.weight_decay),
        config=deepspeed_config(spec))
    return engine


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
