"""The learning-rate schedule and the DeepSpeed config, both pure functions of the RunSpec.

No DeepSpeed scheduler: the step loop sets the LR from `lr_at(step)` before every optimizer
step, so the schedule is a function of the (checkpointed) step alone and resume cannot
drift from it.
"""

from __future__ import annotations

import math
from typing import Any

from common.errors import BadConfig
from spec import RunSpec, TrainConfig
from spec.layout import pp_degree, tp_degree
from trainer.tensor_parallel import check_heads, localize_heads, tensor_parallel_config

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
    """Sequences per rank per micro-batch (what one data cursor names, trainer/data.py)."""
    return spec.train.micro_batch_tokens // spec.model.seq_len


def check_micro_split(spec: RunSpec, split: int) -> None:
    """An OOM-adapted run (workflows/adapt.py) runs each micro-batch as `split` equal
    chunks, one forward/backward each: `split` must divide the micro-batch (with
    pipelines too: each chunk is one of the pipe engine's micro-batches, its weight carried
    to the last stage's loss, trainer/pipeline.py)."""
    mbs = micro_batch_size(spec)
    if split < 1 or mbs % split:
        raise BadConfig("--micro-split", f"{split} does not divide the micro-batch of {mbs} "
                        f"sequences", "pass a power of two that divides it")


def tokens_per_step(spec: RunSpec) -> int:
    """Tokens of one global batch: each data-parallel replica's micro-batches. With TP the
    `tp` ranks of a group read the same batch (trainer/tensor_parallel.py), with PP the
    `pp` stages of a pipeline (trainer/pipeline.py), so a world of W ranks is
    W // (tp x pp) replicas."""
    t = spec.train
    return t.micro_batch_tokens * t.grad_accum * (t.world_size // replica_ranks(spec))


def replica_ranks(spec: RunSpec) -> int:
    """Ranks per data-parallel replica: tp x pp (at most one of them above 1 here)."""
    return tp_degree(spec.train.layout) * pp_degree(spec.train.layout)


def zero_config(t: TrainConfig) -> dict[str, Any]:
    """ZeRO section: communication knobs only where a stage has communication to tune."""
    zero: dict[str, Any] = {"stage": t.zero_stage}
    if t.zero_stage >= 1:
        zero.update(overlap_comm=t.overlap_comm, contiguous_gradients=t.contiguous_gradients,
                    reduce_bucket_size=t.reduce_bucket_size,
                    allgather_bucket_size=t.allgather_bucket_size)
    return zero


def fp16_config(t: TrainConfig) -> dict[str, Any]:
    if t.precision != "fp16":
        return {"enabled": False}
    return {"enabled": True, "loss_scale": 0,  # 0 = dynamic (Micikevicius et al. 2018)
            "initial_scale_power": t.fp16_initial_scale_power,
            "loss_scale_window": t.fp16_loss_scale_window, "hysteresis": t.fp16_hysteresis,
            "min_loss_scale": t.fp16_min_loss_scale}


def deepspeed_config(spec: RunSpec, micro_split: int = 1, tp: int = 1, pp: int = 1
                     ) -> dict[str, Any]:
    """With `micro_split` > 1 (after an OOM) DeepSpeed sees micro-batches that many times
    smaller and that many times more accumulation: the same global batch. With `tp` > 1
    the `tp` ranks of a group share one batch (trainer/tensor_parallel.py), so the global
    batch is world // tp replicas' worth; DeepSpeed 0.19 checks `train_batch_size`
    against the whole world before it builds the TP mesh (runtime/config.py
    `_batch_assertion`), so with TP it is left out and DeepSpeed derives its own count.
    With `pp` > 1 DeepSpeed counts the data-parallel world of its pipe grid (the config is
    built with the PipelineModule's mpu), world // pp replicas: the global batch is theirs."""
    t = spec.train
    mbs = micro_batch_size(spec) // micro_split
    accum = t.grad_accum * micro_split
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": accum,
        "train_batch_size": mbs * accum * (t.world_size // pp),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero_config(t),
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": fp16_config(t),
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
    if tp > 1:
        del config["train_batch_size"]
        config["tensor_parallel"] = tensor_parallel_config(tp)
    return config


def check_device(spec: RunSpec, cuda: bool) -> None:
    """Combinations the spec allows but this device cannot run, as BadConfig naming the field.

    DeepSpeed 0.19's CPU accelerator has no fp16 (it raises "Type fp16 is not supported on
    your device" after building the engine); bf16 and ZeRO 0-3 do run there (DESIGN §5).
    """
    if spec.train.precision == "fp16" and not cuda:
        raise BadConfig("train.precision", "fp16 needs CUDA; DeepSpeed's CPU accelerator has "
                        "no fp16", "use bf16 or fp32 on CPU")


def build_engine(spec: RunSpec, model, micro_split: int = 1, tp: int = 1, pp: int = 1):
    """deepspeed.initialize with the derived config; decay/no-decay parameter groups; every
    checkpoint file it loads is read weights-only (trainer/safe_load.py). With `tp` > 1
    AutoTP shards the model's matrices over groups of `tp` ranks (trainer/tensor_parallel.py);
    with `pp` > 1 the model is a PipelineModule of `pp` stages and the engine DeepSpeed's
    PipelineEngine, its update held back for engine.step() (trainer/pipeline.py)."""
    import deepspeed
    import torch

    check_device(spec, torch.cuda.is_available())
    from trainer.model import param_groups
    from trainer.optim import build_optimizer
    from trainer.pipeline import defer_update, pipeline_module
    from trainer.safe_load import install_safe_loading

    check_micro_split(spec, micro_split)
    check_heads(spec.model.n_heads, spec.model.n_kv_heads, tp)
    config = deepspeed_config(spec, micro_split, tp, pp)
    if pp > 1:  # this rank's stage: its layers alone are the engine's module
        model = pipeline_module(model, pp)
    # The optimizer is ours (an AdamW whose update a spike verdict can veto, trainer/optim.py)
    # with exactly the config's hyperparameters; ZeRO accepts it as a torch AdamW subclass.
    optimizer = build_optimizer(param_groups(model, spec.train.weight_decay),
                                config.pop("optimizer")["params"])
    config["zero_allow_untested_optimizer"] = True
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if tp > 1:
        localize_heads(engine.module)
    if pp > 1:
        defer_update(engine)
    install_safe_loading(engine)  # load_checkpoint never unpickles code (DESIGN §3)
    trim_per_step_work(engine)
    return engine


def plain_fp32(engine) -> bool:
    """ZeRO 0 in fp32: DeepSpeed's plain engine path (its own gradient all-reduce, its own
    clipping of the module's gradients, then our optimizer)."""
    return not (engine.fp16_enabled() or engine.bfloat16_enabled()
                or engine.zero_optimization())


def trim_per_step_work(engine) -> None:
    """Take out of DeepSpeed's plain fp32 step what need not run there (same gradients,
    same update, bit for bit):

    - with one data-parallel rank, the gradient "all-reduce" at the accumulation boundary:
      it flattens every gradient into a buffer, reduces it over a group of one, divides by
      one and copies it back (~0.35 ms a step on the benchmark's 1M-parameter GPT on CPU);
    - the gradient norm computed twice: DeepSpeed clips with a norm it then drops, and the
      step loop's probe measured it again (trainer/step_metrics.py). Its clipping now keeps
      the norm it computed, where `engine.get_global_grad_norm()` reads it as at the other
      ZeRO stages; an engine that never calls it leaves the probe measuring its own."""
    if not plain_fp32(engine):
        return
    if engine.dp_world_size == 1:
        engine.enable_backward_allreduce = False
        engine.pipeline_enable_backward_allreduce = False  # the pipe engine's own reduction
    engine.clip_fp32_gradients = lambda: keep_clip_norm(engine)


def keep_clip_norm(engine) -> None:
    """DeepSpeed's fp32 clipping (runtime.utils.clip_grad_norm_ as its clip_fp32_gradients
    calls it), keeping the pre-clip norm it computes. With one data-parallel rank and no
    model parallelism, the same arithmetic in two fused calls instead of a Python loop over
    the parameters, and without its norm "all-reduce" over the group of one (a gloo
    collective every step): the same norm and the same clipped gradients, bit for bit."""
    from deepspeed.runtime.utils import clip_grad_norm_

    from trainer.pipeline import clip_pipeline, is_pipeline

    if is_pipeline(engine):  # its clip_grad_norm_ would count the first stage only
        engine._global_grad_norm = clip_pipeline(engine, engine.gradient_clipping())  # noqa: SLF001
        return
    if engine.mpu is not None or engine.dp_world_size != 1:
        engine._global_grad_norm = clip_grad_norm_(  # noqa: SLF001 — get_global_grad_norm's
            parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(),
            mpu=engine.mpu)
        return
    engine._global_grad_norm = clip_one_rank(  # noqa: SLF001
        [p.grad.data for p in engine.module.parameters() if p.grad is not None],
        engine.gradient_clipping())


def clip_one_rank(grads: list, max_norm: float):
    """DeepSpeed's clip_grad_norm_ (2-norm, no model parallelism) on one rank: the norm is
    the square root of the summed squares of the per-tensor norms; every gradient is scaled
    by min(1, max_norm / (norm + 1e-6)). Returns the pre-clip norm (a 1-element tensor)."""
    import torch

    total = torch.stack(torch._foreach_norm([g.detach().float() for g in grads], 2.0))
    total = total.pow(2.0).sum().float().pow(1.0 / 2.0)
    coef = torch.tensor([float(max_norm)], device=total.device) / (total + 1e-6)
    coef = torch.min(torch.tensor([1.0], device=coef.device), coef)
    torch._foreach_mul_(grads, coef.reshape(()))
    return total


def veto_next_update(engine) -> None:
    """The next engine.step() leaves weights, moments and step counts unchanged."""
    engine.basic_optimizer.veto = True


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
