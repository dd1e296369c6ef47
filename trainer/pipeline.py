"""Pipeline parallelism (PP) for the trainer's GPT through DeepSpeed's `PipelineModule`.

The GPT is laid out as a sequence of layers (`pipeline_layers`): the embedding, each
transformer block, the final norm and the lm_head; DeepSpeed's `PipelineModule` gives each
of `pp` stages an equal run of blocks (`partition_method="type:PipeBlock"`, the embedding
on the first stage, norm and head on the last) and its `PipelineEngine` runs a step's
micro-batches as 1F1B (its `TrainSchedule`: Narayanan et al. 2021, arXiv 2104.04473,
section 2.2.1), the loss on the last stage (`loss_fn`). With tied embeddings the first and
last stages each hold the embedding matrix (a `TiedLayerSpec`) and DeepSpeed sums its two
gradients over them before the update.

Packed rows carry their per-token positions and document ids from stage to stage as
tensors of the activation tuple `(x, position_ids, doc_ids)`: the engine sends every tensor
of the tuple forward but gradients only for floating-point ones (`_exec_send_grads` skips
the others, `_exec_recv_activations` sets requires_grad only on them), so the int64 ids
travel without a gradient. Each block derives RoPE's rotation and the per-document
attention segments from them, as trainer/model.py GPT.forward does once.

DeepSpeed lays ranks out as a (pipe, data) mesh, data fastest
(runtime/pipe/topology.py `PipeDataParallelTopology`): a rank's stage is rank // dp and its
data-parallel replica rank % dp; the stages of one pipeline read the same batches (the
first stage its inputs, the last its targets: `pp_ranks`).

The step loop keeps its shape (trainer/loop.py): `train_batch` runs forward and backward
of every micro-batch and the gradient reductions, but not the update — the schedule's
`OptimizerStep` is held back (`defer_update`) and `engine.step()` applies it after the loss
is judged, so a skip or a rollback vetoes it as without pipelines.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from common.errors import BadConfig
from trainer.model import (
    GPT,
    IGNORE,
    Block,
    block_causal_mask,
    cu_seqlens,
    packed_mode,
    rope_at,
)

TIED = "embed"  # the TiedLayerSpec key of the embedding shared by the first and last stage


@dataclass(frozen=True, kw_only=True)
class PPRanks:
    """Where a global rank sits in DeepSpeed's (pipe, data) mesh."""

    dp_rank: int  # which data-parallel replica: the batch source's rank
    dp_world: int  # how many replicas: the batch source's world
    stage: int  # which pipeline stage this rank runs


def pp_ranks(rank: int, world: int, pp: int) -> PPRanks:
    """Pure: DeepSpeed's mesh of shape (pp, world // pp), row-major, so ranks
    stage*dp .. stage*dp + dp-1 are one stage of the dp pipelines, and ranks r, r+dp, ...
    one pipeline, which reads one batch."""
    if pp < 1 or world % pp:
        raise BadConfig("train.layout.pp", f"PP {pp} does not divide the world of {world}",
                        "make pp divide nodes x procs_per_node")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    dp = world // pp
    return PPRanks(dp_rank=rank % dp, dp_world=dp, stage=rank // dp)


# ---- the GPT as a sequence of layers -------------------------------------------------------
def _split(inputs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A layer's input: x alone (fixed windows) or (x, position_ids, doc_ids) (packed)."""
    if isinstance(inputs, torch.Tensor):
        return inputs, ()
    return inputs[0], tuple(inputs[1:])


def _join(x: torch.Tensor, packed: tuple[torch.Tensor, ...]):
    return (x, *packed) if packed else x


class PipeEmbed(nn.Module):
    """Layer 0: token ids to embeddings; the packed ids pass through."""

    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, inputs):
        idx, packed = _split(inputs)
        return _join(self.embed(idx), packed)


class PipeBlock(nn.Module):
    """Layers 1..n_layers: one transformer block, with RoPE and the attention's document
    segments derived from the packed ids exactly as GPT.forward derives them."""

    def __init__(self, block: Block, gpt: GPT) -> None:
        super().__init__()
        self.block = block
        self.checkpointed = gpt.cfg.activation_checkpointing
        self.packed_sdpa = gpt.packed_sdpa
        self.register_buffer("rope_cos", gpt.rope_cos, persistent=False)
        self.register_buffer("rope_sin", gpt.rope_sin, persistent=False)

    def forward(self, inputs):
        x, packed = _split(inputs)
        position_ids, doc_ids = packed if packed else (None, None)
        cos, sin = rope_at(self.rope_cos, self.rope_sin, x.shape[1], position_ids)
        mask, cu, max_len = None, None, 0
        if doc_ids is not None:
            dtype = (torch.get_autocast_dtype(x.device.type)
                     if torch.is_autocast_enabled(x.device.type) else x.dtype)
            mode = packed_mode(self.block.attn.kernel, dtype, x.device, self.packed_sdpa)
            if mode == "mask":
                mask = block_causal_mask(doc_ids)
            else:
                cu, max_len = cu_seqlens(doc_ids)
                max_len = max_len if mode == "flash_varlen" else 0
        if self.checkpointed and self.training and torch.is_grad_enabled():
            x = checkpoint(self.block, x, cos, sin, mask, cu, max_len, use_reentrant=False)
        else:
            x = self.block(x, cos, sin, mask, cu, max_len)
        return _join(x, packed)


class PipeNorm(nn.Module):
    """The final norm; the packed ids end here (the head needs only the activations)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, inputs):
        return self.norm(_split(inputs)[0])


class PipeHead(nn.Module):
    """The untied lm_head: activations to logits."""

    def __init__(self, lm_head: nn.Linear) -> None:
        super().__init__()
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(x)


def tied_logits(module: PipeEmbed, x: torch.Tensor) -> torch.Tensor:
    """The tied lm_head on the last stage: the embedding matrix as a bias-free Linear."""
    return F.linear(x, module.embed.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss: GPT.forward's mean cross-entropy over scored targets."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE)


def stage_loss(teacher: Any = None):
    """The last stage's `loss_fn`. Targets y alone: `lm_loss`. Targets (y, weight, x,
    *packed) — a split micro-batch's chunk, or a student's rows (`step_batches`): the
    cross-entropy, or with a teacher its distillation loss on the same rows
    (trainer/teacher.py), times the chunk's weight as trainer/loop.py forward_backward
    weighs it (a weight of 1 for a whole micro-batch)."""
    def loss(logits: torch.Tensor, targets) -> torch.Tensor:
        if isinstance(targets, torch.Tensor):
            return lm_loss(logits, targets)
        y, weight, x, *packed = targets
        if teacher is None:
            value = lm_loss(logits, y)
        else:
            value = teacher.loss(logits, x, y, **dict(zip(("position_ids", "doc_ids"), packed)))
        return torch.where(weight > 0, value * weight, torch.zeros_like(value))

    return loss


def pipeline_layers(gpt: GPT) -> list[Any]:
    """The GPT's own modules (its weights as built, or as init_from loaded them) in order:
    embedding, blocks, norm, head. Tied embeddings: the first and last entries are one
    `TiedLayerSpec`, built on each of the two stages from the same parameter."""
    from deepspeed.pipe import TiedLayerSpec

    blocks = [PipeBlock(block, gpt) for block in gpt.blocks]
    if gpt.cfg.tie_embeddings:
        tied = {"tied_weight_attr": ["embed.weight"]}
        return [TiedLayerSpec(TIED, PipeEmbed, gpt.embed, **tied), *blocks,
                PipeNorm(gpt.norm),
                TiedLayerSpec(TIED, PipeEmbed, gpt.embed, forward_fn=tied_logits, **tied)]
    return [PipeEmbed(gpt.embed), *blocks, PipeNorm(gpt.norm), PipeHead(gpt.lm_head)]


def pipeline_module(gpt: GPT, pp: int):
    """DeepSpeed's PipelineModule over `pp` stages, an equal number of blocks each (spec
    validation has made pp divide n_layers). Its start-up prints (seeds, the partition) go
    to a string: the segment's logs are structured. Without autograd: it broadcasts the
    tied embedding in place from the first stage (`_synchronize_tied_weights`), and
    recorded, that broadcast sits in the last stage's graph ("c10d::broadcast_: an
    autograd kernel was not registered", warned at every backward)."""
    from deepspeed.pipe import PipelineModule

    with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        return PipelineModule(layers=pipeline_layers(gpt), num_stages=pp, loss_fn=stage_loss(),
                              partition_method=f"type:{PipeBlock.__name__}")


# ---- the step --------------------------------------------------------------------------
def is_pipeline(engine) -> bool:
    """Whether `engine` is DeepSpeed's PipelineEngine (its module a PipelineModule)."""
    return getattr(engine, "pipeline_parallelism", False) is True


def engine_pp(engine) -> int:
    """The pipeline stages of an engine (1 without PP)."""
    return engine.num_stages if is_pipeline(engine) else 1


def defer_update(engine) -> None:
    """`train_batch` runs the schedule without its `OptimizerStep`, and `engine.step()`
    runs that instruction (DeepSpeed's `_exec_optimizer_step`: clipping, the optimizer,
    zeroing the gradients, the step count) when the loop calls it, after the verdict.
    Without clipping at ZeRO 0 nothing computes the whole model's gradient norm (the step
    line's `grad_norm`: the probe, trainer/step_metrics.py, would read this stage's
    alone), so the step keeps `pipeline_grad_norm`'s, as the clipping does."""
    from deepspeed.runtime.pipe import schedule

    plain = engine._train_schedule  # noqa: SLF001 — the one schedule train_batch runs

    class HeldBack(schedule.PipeSchedule):
        def __init__(self, inner: schedule.PipeSchedule) -> None:
            self.inner = inner

        def num_pipe_buffers(self) -> int:
            return self.inner.num_pipe_buffers()

        def steps(self):
            for cmds in self.inner.steps():
                yield [c for c in cmds if not isinstance(c, schedule.OptimizerStep)]

    def step() -> None:
        if not engine.gradient_clipping() and not engine.zero_optimization():
            engine._global_grad_norm = pipeline_grad_norm(engine)  # noqa: SLF001
        engine._exec_optimizer_step()  # noqa: SLF001

    engine._train_schedule = lambda: HeldBack(plain())
    engine.step = step


def step_batches(batches, state, step: int, micro_batches: int, split: int = 1,
                 teacher: Any = None) -> Iterator[tuple]:
    """The step's micro-batches in DeepSpeed's pipe format, `(inputs, targets)` with inputs
    x or (x, position_ids, doc_ids), each as `split` equal chunks (an OOM-adapted run, as
    trainer/loop.py forward_backward splits them). The cursors are taken here, past skipped
    ranges, so every stage advances `state.data_cursor` alike (the middle stages read
    nothing). Split, or with a teacher, the targets are (y, weight, x, *packed): the
    chunk's weight (trainer/loop.py chunk_weights; 1 unsplit) and the rows the teacher
    reads on the last stage (`stage_loss`)."""
    from trainer.data import skip_past
    from trainer.loop import chunk_weights  # here: trainer/loop.py imports this module

    cursors = []
    for _ in range(micro_batches):
        state.data_cursor = skip_past(state.data_cursor, state.skip_ranges)
        cursors.append(state.data_cursor)
        state.data_cursor += 1
    for cursor in cursors:
        tensors = batches.get(cursor, step)
        chunks = [tensors] if split == 1 else list(zip(*(t.chunk(split) for t in tensors)))
        weights = chunk_weights([c[1] for c in chunks])
        for (x, y, *packed), weight in zip(chunks, weights):
            if weight is None and teacher is None:
                yield (_join(x, tuple(packed)), y)
                continue
            weight = torch.ones(()) if weight is None else weight
            yield (_join(x, tuple(packed)), (y, weight, x, *packed))


def teach(engine, teacher) -> None:
    """The last stage's loss becomes the distillation loss against `teacher`
    (trainer/teacher.py) on the rows `step_batches` hands it with the targets: the student's
    logits are there, and every rank has loaded the teacher. The other stages' teacher is
    never run: its cost is the last stage's (`last_stages`)."""
    engine.module.loss_fn = stage_loss(teacher)


def last_stages(engine, value: Any) -> Any:
    """`value` as the last stage of this rank's pipeline holds it (what only that stage
    measures: the teacher's cost). Collective: every stage of the pipeline."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=engine.grid.stage_to_global(engine.num_stages - 1),
                               group=engine.grid.get_pipe_parallel_group())
    return box[0]


def pipeline_forward_backward(engine, batches, state, step: int, micro_batches: int,
                              split: int = 1, teacher: Any = None) -> torch.Tensor:
    """forward_backward's contract (trainer/loop.py) for a pipeline: every micro-batch of
    `step` (each as `split` chunks) forward and backward through the stages, the gradients
    reduced, no update; returns the sum of the passes' losses as the DP loop's sum would
    be, from DeepSpeed's mean over the passes and data replicas, which every stage holds."""
    data = step_batches(batches, state, step, micro_batches, split, teacher)
    if engine.is_first_stage() or engine.is_last_stage():
        mean = engine.train_batch(data)
    else:  # a middle stage reads no batch; the cursors still advance with the step's
        for _ in data:
            pass
        mean = engine.train_batch(iter(()))
    return mean.detach().float().reshape(()) * (micro_batches * split)


def evaluate_pipeline(engine, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """trainer/evaluate.py evaluate_model's mean validation loss, through the stages: the
    pipe engine's `eval_batch` over every batch (its inference schedule, no gradients),
    the mean over them and the replicas, which every stage holds. The validation rows are
    (x, y) windows, no packed ids: the activations' shape changes from the training
    tuple's, and the engine caches the shapes it exchanged, so they are reset before and
    after (`reset_activation_shape`). Collective: every rank of every pipeline."""
    engine.reset_activation_shape()
    try:
        loss = engine.eval_batch(iter(batches), num_micro_batches=len(batches))
    finally:
        engine.reset_activation_shape()
    return float(loss)  # host sync


def pipeline_grad_norm(engine) -> torch.Tensor:
    """The 2-norm of the whole model's gradient from one stage (a 1-element tensor):
    its squared norms summed over the stages of its pipeline (collective: the pipe group),
    the tied embedding's later copies (`ds_pipe_replicated`) left out."""
    import torch.distributed as dist

    grads = [p.grad for p in engine.module.parameters()
             if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)]
    squares = torch.stack([g.detach().float().norm(2.0) for g in grads]).pow(2.0).sum()
    dist.all_reduce(squares, group=engine.mpu.get_model_parallel_group())
    return squares.pow(0.5).reshape(1)


def clip_pipeline(engine, max_norm: float) -> torch.Tensor:
    """DeepSpeed's fp32 2-norm clipping for a pipeline stage: the global norm of the whole
    model's gradient — each stage's squared norms summed over the stages of its pipeline
    (the tied embedding counted once: DeepSpeed marks its later copies
    `ds_pipe_replicated`) — and every gradient scaled by min(1, max_norm / (norm + 1e-6)).
    Its own `clip_grad_norm_` counts only the first stage under PP: it keeps parameters
    on model-parallel rank 0, and a stage's rank in the pipe group is its stage
    (runtime/utils.py), so the norm would miss the other stages' gradients."""
    total = pipeline_grad_norm(engine)
    coef = torch.clamp(torch.tensor([float(max_norm)]) / (total + 1e-6), max=1.0)
    every = [p.grad for p in engine.module.parameters() if p.grad is not None]
    torch._foreach_mul_(every, coef.reshape(()))
    return total


# ---- checkpoints (their per-layer files merge back in trainer/merge.py) ----------------
def loading(engine):
    """The context a checkpoint loads in: for a pipeline, without autograd — its load
    broadcasts the tied embedding in place again (`load_state_dir`), see
    `pipeline_module`."""
    return torch.no_grad() if is_pipeline(engine) else contextlib.nullcontext()


def check_saved_pp(extra: dict[str, Any], step: int, pp: int) -> None:
    """A checkpoint resumes at the pipeline degree it was written at: each stage loads its
    own layers' files and its `mp_rank_RR` optimizer state, and nothing here repartitions
    them. Its manifest's `extra.pp` says which (absent: 1). BadConfig before DeepSpeed
    fails on a missing file; CorruptCheckpoint when the field is not a positive whole
    number."""
    from storage.manifest import MANIFEST, CorruptCheckpoint

    saved = extra.get("pp", 1)
    if type(saved) is not int or saved < 1:  # noqa: E721 — a bool is not a degree
        raise CorruptCheckpoint(step, MANIFEST, "extra.pp a positive integer", repr(saved)[:80])
    if saved != pp:
        raise BadConfig("train.layout.pp", f"checkpoint step {step} was written at PP {saved}, "
                        f"this segment runs PP {pp}; its stages are not repartitioned",
                        f"resume with pp {saved}, or start a new run from its weights with "
                        "train.init_from (the readers merge the layers; any layout loads them)")
