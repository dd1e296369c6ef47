"""Tensor parallelism (TP) for the trainer's GPT through DeepSpeed's AutoTP training support.

DeepSpeed (>= 0.16.4) shards a model's Linear layers when its config carries
`"tensor_parallel": {"autotp_size": tp, "partition_config": ...}`. For a model it does not
know, the partition config names the layers: Megatron-LM's split (Shoeybi et al. 2019,
arXiv 1909.08053, section 3) — the attention's wq/wk/wv and the MLP's w1/w3 column-parallel
(each rank computes its heads and its slice of the hidden units), wo and w2 row-parallel
(their partial outputs summed by an all-reduce). Everything else (embedding, norms, the tied
lm_head) stays whole on every rank. Each rank then holds n_heads/tp query heads and
n_kv_heads/tp kv heads, which `localize_heads` tells the attention modules.

DeepSpeed lays ranks out as a (data, tensor) mesh, tensor fastest
(deepspeed/utils/groups.py `_init_tp_mesh_device`): the `tp` consecutive ranks of a TP group
are one data-parallel replica, so they must read the same batch (`tp_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import BadConfig

COLUMN = (r".*\.attn\.w[qkv]\.weight$", r".*\.ffn\.w[13]\.weight$")
ROW = (r".*\.attn\.wo\.weight$", r".*\.ffn\.w2\.weight$")


@dataclass(frozen=True, kw_only=True)
class TPRanks:
    """Where a global rank sits in the (data, tensor) mesh."""

    dp_rank: int  # which data-parallel replica: the batch source's rank
    dp_world: int  # how many replicas: the batch source's world
    tp_rank: int  # which shard of the matrices this rank holds


def tp_ranks(rank: int, world: int, tp: int) -> TPRanks:
    """Pure: DeepSpeed's mesh of shape (world // tp, tp), row-major, so ranks
    dp_rank*tp .. dp_rank*tp + tp-1 form one TP group and read one batch."""
    if tp < 1 or world % tp:
        raise BadConfig("train.layout.tp", f"TP {tp} does not divide the world of {world}",
                        "make tp divide nodes x procs_per_node")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    return TPRanks(dp_rank=rank // tp, dp_world=world // tp, tp_rank=rank % tp)


def check_heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Each rank holds whole heads: tp must divide both head counts."""
    for field, n in (("model.n_heads", n_heads), ("model.n_kv_heads", n_kv_heads)):
        if n % tp:
            raise BadConfig(field, f"{n} heads do not split over TP {tp}",
                            f"use a tp dividing {n}, or a head count divisible by {tp}")


def partition_config() -> dict[str, Any]:
    """AutoTP's custom partition config for trainer/model.py's GPT (DeepSpeed's
    `AutoTPConfig.from_dict` format). No default specs: only the named layers are split,
    and `strict_mode` off lets the unnamed ones (embedding, lm_head) stay replicated."""
    return {"use_default_specs": False,
            "layer_specs": [{"patterns": list(COLUMN), "partition_type": "column"},
                            {"patterns": list(ROW), "partition_type": "row"}]}


def tensor_parallel_config(tp: int) -> dict[str, Any]:
    """The `tensor_parallel` section of the DeepSpeed config. No `dtype`: DeepSpeed 0.19
    reads it only to merge with `deepspeed.tp_model_init` (a torch.dtype, not JSON); on this
    path the weights keep the engine's precision (bf16 or fp32 as the config says)."""
    return {"autotp_size": tp, "partition_config": partition_config()}


def localize_heads(model) -> None:
    """After AutoTP sharded wq/wk/wv, each rank's attention computes a slice of the heads:
    its view of the projections must say how many. Read from the shards themselves (the
    head size is unchanged): AutoTP also rewrites some attributes by name
    (auto_tp.py `update_mp_params`: `n_heads` is on its list, `n_kv` is not), so counting
    rows is the one answer that does not depend on its list."""
    for block in model.blocks:
        attn = block.attn
        attn.n_heads = attn.wq.weight.shape[0] // attn.head_dim
        attn.n_kv = attn.wk.weight.shape[0] // attn.head_dim


def check_saved_tp(extra: dict[str, Any], step: int, tp: int) -> None:
    """A checkpoint resumes at the TP degree it was written at: each rank loads its own
    `mp_rank_RR` shards, and nothing here reshards them to another degree. Its manifest's
    `extra.tp` says which (absent: 1, a checkpoint written without TP). BadConfig before
    DeepSpeed fails on a shape; CorruptCheckpoint when the field is not a positive whole
    number (readers fall back past it)."""
    from storage.manifest import MANIFEST, CorruptCheckpoint

    saved = extra.get("tp", 1)
    if type(saved) is not int or saved < 1:  # noqa: E721 — a bool is not a degree
        raise CorruptCheckpoint(step, MANIFEST, "extra.tp a positive integer", repr(saved)[:80])
    if saved != tp:
        raise BadConfig("train.layout.tp", f"checkpoint step {step} was written at TP {saved}, "
                        f"this segment runs TP {tp}; its shards are not resharded to another "
                        "degree", f"resume with tp {saved}, or start a new run from its weights "
                        "with train.init_from (the readers merge the shards; any tp loads them)")


def engine_tp(engine) -> int:
    """The TP degree a DeepSpeed engine was built with (its config's `autotp_size`, 0
    when the section is absent: no TP, 1)."""
    return max(1, int(engine.autotp_size()))
