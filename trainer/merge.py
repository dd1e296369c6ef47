"""A sharded or layered checkpoint's files merged back into the GPT's one state dict, for
the readers that need the whole model (trainer/evaluate.py: evaluation, export, init_from,
the teacher). Pure: the files are read elsewhere; what is merged here is checked.

The files come from the bucket (docs/security.md: the bucket is data, and not trusted to be
whole): shards or layers that do not fit together — a file missing among them, one too
many, a name one holds and another lacks, a value that is not a tensor, pieces of unequal
dtype or shape — and a merged dict that is not the model's — a weight missing or
unexpected, another shape, integers where floats belong — are each a CorruptCheckpoint
naming the step and the file. Readers treat that as any damaged file: a
`checkpoint_corrupt` event and a fallback to the previous committed step. Nothing here
raises KeyError or RuntimeError on the bucket's say.

Tensor parallelism (trainer/tensor_parallel.py): TP rank r's module states are
`mp_rank_{r:02d}_model_states.pt`; the manifest's `extra.tp` says how many (absent: 1).
Pipeline parallelism (trainer/pipeline.py): layer i's weights are
`layer_{i:02d}-model_states.pt`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from storage.manifest import MANIFEST, CorruptCheckpoint
from trainer.tensor_parallel import COLUMN, ROW

TP_FILE = re.compile(r"mp_rank_([0-9]{2})_model_states\.pt")
LAYER_FILE = re.compile(r"layer_([0-9]{2,6})-model_states\.pt")


class WeightsMisfit(CorruptCheckpoint):
    """A checkpoint whole and consistent in itself whose shapes are not the model's. To a
    reader of the run's own checkpoints (built from its own spec) that is corruption like
    any other; to a reader of another run's weights (init_from, the teacher) it may be a
    model config that does not fit them, and such a reader says so (BadConfig)."""


# ---- tensor parallelism ------------------------------------------------------------------
def tp_files(names: list[str], step: int, extra: dict[str, Any] | None = None) -> list[str]:
    """Pure: the TP ranks' module-states files among a checkpoint directory's `names`, in
    rank order: ranks 0..n-1, one file each, and with the manifest's `extra` as many as its
    `tp` (absent: 1). CorruptCheckpoint naming the step and the file otherwise."""
    ranks = sorted(int(m.group(1)) for n in names if (m := TP_FILE.fullmatch(n)))
    for position, rank in enumerate(ranks):
        if rank != position:  # a gap: the shard before this one is missing
            raise CorruptCheckpoint(step, shard_file(position), f"TP shards 0..{len(ranks) - 1}",
                                    f"missing, {shard_file(rank)} present")
    if extra is not None:
        tp = extra.get("tp", 1)
        if type(tp) is not int or tp < 1:  # noqa: E721 — a bool is not a degree
            raise CorruptCheckpoint(step, MANIFEST, "extra.tp a positive integer",
                                    repr(tp)[:80])
        if len(ranks) != tp:
            raise CorruptCheckpoint(step, shard_file(min(len(ranks), tp)), f"{tp} TP shards "
                                    "(the manifest's extra.tp)", f"{len(ranks)} shard files")
    return [shard_file(r) for r in ranks]


def shard_file(tp_rank: int) -> str:
    """The module-states file DeepSpeed writes for a TP rank."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def split_dim(name: str) -> int | None:
    """Pure: the dimension AutoTP split a weight along (None: whole on every rank)."""
    if any(re.match(p, name) for p in COLUMN):
        return 0
    return 1 if any(re.match(p, name) for p in ROW) else None


def merge_shards(shards: list[dict[str, Any]], step: int) -> dict[str, Any]:
    """Pure: the whole model's state dict from the `tp` ranks' module states, in TP rank
    order (DeepSpeed writes rank r's as `shard_file(r)`). The inverse of the partition
    config: column-parallel matrices were split along their output rows (dim 0),
    row-parallel ones along their input columns (dim 1), AutoTP's even split in rank order;
    everything else is whole on every rank, and rank 0's is taken.

    The shards come from the bucket: ones that do not fit together — another set of names
    than rank 0's, a value that is not a tensor, another dtype or shape than rank 0's
    (an even split has equal pieces) — are a CorruptCheckpoint naming the step and the
    shard's file, so a reader falls back to an older step as for any damaged file."""
    first = shards[0]
    for rank, shard in enumerate(shards):
        for name, value in shard.items():
            if not (isinstance(name, str) and isinstance(value, torch.Tensor)):
                raise CorruptCheckpoint(step, shard_file(rank), "names of tensors",
                                        f"{str(name)[:80]!r}: {type(value).__name__}")
        if shard.keys() != first.keys():
            raise CorruptCheckpoint(step, shard_file(rank), f"the names of {shard_file(0)}",
                                    f"missing {sorted(first.keys() - shard.keys())[:3]}, "
                                    f"extra {sorted(shard.keys() - first.keys())[:3]}")
    if len(shards) == 1:
        return first
    merged = {}
    for name, whole in first.items():
        dim = split_dim(name)
        for rank, shard in enumerate(shards):
            piece = shard[name]
            if piece.dtype != whole.dtype or piece.shape != whole.shape or \
                    (dim is not None and piece.dim() <= dim):
                raise CorruptCheckpoint(step, shard_file(rank), f"{name} {whole.dtype} "
                                        f"{tuple(whole.shape)}, a matrix as in {shard_file(0)}",
                                        f"{piece.dtype} {tuple(piece.shape)}")
        merged[name] = whole if dim is None else torch.cat([s[name] for s in shards], dim=dim)
    return merged


# ---- pipeline parallelism ----------------------------------------------------------------
def layer_files(names: list[str]) -> list[tuple[int, str]]:
    """Pure: the pipeline's per-layer weight files of a checkpoint directory, by layer."""
    found = [(int(m.group(1)), n) for n in names if (m := LAYER_FILE.fullmatch(n))]
    return sorted(found)


def layer_file(index: int) -> str:
    """The file DeepSpeed writes a pipeline layer's weights to."""
    return f"layer_{index:02d}-model_states.pt"


def gpt_name(index: int, name: str) -> str:
    """Pure: GPT's name of layer `index`'s weight `name`: a block's `block.*` is
    `blocks.{index-1}.*`; the embedding, norm and head layers already use GPT's names."""
    return f"blocks.{index - 1}.{name[len('block.'):]}" if name.startswith("block.") else name


def merge_layers(layers: list[tuple[int, dict[str, Any]]], step: int, tied: bool = True
                 ) -> dict[str, Any]:
    """Pure: the ordinary GPT state dict from a pipeline's per-layer states (`layer_file`),
    named by `gpt_name`. Tied embeddings (`tied`: the model's, when the reader knows it):
    no head file (the last stage's copy is the embedding's, not saved again), so
    `lm_head.weight` is the embedding's, as GPT's state dict has it; untied, a missing head
    stays missing (never the embedding in its place). The files come from the bucket: a layer missing among them, a value that
    is not a tensor, or a weight two layers name is a CorruptCheckpoint naming the step and
    the file, so a reader falls back to an older step as for any damaged file."""
    for position, (index, _) in enumerate(layers):
        if index != position:  # sorted: a gap, or two files for one layer (layer_2, _02)
            raise CorruptCheckpoint(step, layer_file(position), f"layers 0..{len(layers) - 1}"
                                    " one file each", f"layer {index} in its place")
    merged: dict[str, Any] = {}
    origin: dict[str, int] = {}
    for index, sd in layers:
        for name, tensor in sd.items():
            if not (isinstance(name, str) and isinstance(tensor, torch.Tensor)):
                raise CorruptCheckpoint(step, layer_file(index), "names of tensors",
                                        f"{str(name)[:80]!r}: {type(tensor).__name__}")
            name = gpt_name(index, name)
            if name in merged:
                raise CorruptCheckpoint(step, layer_file(index), f"{name} in one layer",
                                        f"also in {layer_file(origin[name])}")
            merged[name], origin[name] = tensor, index
    if tied and "lm_head.weight" not in merged and "embed.weight" in merged:
        merged["lm_head.weight"] = merged["embed.weight"]
    return merged


# ---- the model ---------------------------------------------------------------------------
def weights_problem(state: dict[str, Any], expected: dict[str, torch.Tensor]
                    ) -> tuple[str, str, str, bool] | None:
    """Pure: the first way a merged state dict is not the model's (`expected`: the model's
    own state dict, or its shapes on the meta device), as (weight, expected, found,
    misfit: whether only a shape differs), or None when it fits. A tensor of another
    floating dtype fits (loading converts bf16 to fp32)."""
    missing = [k for k in expected if k not in state]
    if missing:
        return missing[0], "every weight of the model", f"no {missing[0]}", False
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        return unexpected[0], "only the model's weights", f"{str(unexpected[0])[:80]!r}", False
    for name, want in expected.items():
        got = state[name]
        if not isinstance(got, torch.Tensor):
            return name, "a tensor", type(got).__name__, False
        if got.is_floating_point() != want.is_floating_point():
            return name, f"{name} {want.dtype}", f"{got.dtype}", False
        if got.shape != want.shape:
            return name, f"{name} of shape {tuple(want.shape)}", f"{tuple(got.shape)}", True
    return None


def check_weights(state: dict[str, Any], expected: dict[str, torch.Tensor], step: int,
                  origin: dict[str, str], files: str) -> None:
    """CorruptCheckpoint (WeightsMisfit where only a shape differs) naming the step and the
    file the misfit weight came from (`origin`; `files`, the files read, for a weight that
    none holds) when `state` is not the model's."""
    problem = weights_problem(state, expected)
    if problem is not None:
        name, want, found, misfit = problem
        error = WeightsMisfit if misfit else CorruptCheckpoint
        raise error(step, origin.get(name, files), want, found)
