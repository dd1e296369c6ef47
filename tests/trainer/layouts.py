"""Tiny sharded (TP) and layered (PP) checkpoints of a GPT, written as DeepSpeed lays them
out — TP rank r's `mp_rank_{r:02d}_model_states.pt` holding `{"module": shard}` split as
AutoTP splits (trainer/tensor_parallel.py), a pipeline's `layer_{i:02d}-model_states.pt`
holding each layer's own names (trainer/pipeline.py) — and committed to a checkpoint store,
so the readers that merge them can be fed good and damaged ones without DeepSpeed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from storage.checkpoints import CheckpointStore
from trainer.merge import layer_file, shard_file, split_dim


def tp_shards(state: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """The `tp` ranks' module states: column-parallel weights split by rows, row-parallel by
    columns, evenly in rank order; everything else whole on every rank."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in state.items():
        dim = split_dim(name)
        pieces = [tensor] * tp if dim is None else list(tensor.chunk(tp, dim=dim))
        for shard, piece in zip(shards, pieces):
            shard[name] = piece.clone()
    return shards


def pp_layers(state: dict[str, torch.Tensor], n_layers: int, tied: bool
              ) -> list[dict[str, torch.Tensor]]:
    """The pipeline's per-layer states: the embedding, each block (`block.*`), the norm and,
    untied, the head (tied: no head file, as DeepSpeed saves a tied layer once)."""
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layers + (2 if tied else 3))]
    for name, tensor in state.items():
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            layers[int(index) + 1][f"block.{rest}"] = tensor.clone()
        elif name == "embed.weight":
            layers[0][name] = tensor.clone()
        elif name == "norm.weight":
            layers[n_layers + 1][name] = tensor.clone()
        elif not tied:  # lm_head.weight
            layers[n_layers + 2][name] = tensor.clone()
    return layers


def commit_files(store: Path, run_id: str, step: int, files: dict[str, object], tmp: Path,
                 **extra: int) -> CheckpointStore:
    """Commit `files` (name: what torch.save writes there) as run `run_id`'s `step`, with
    `extra` in its manifest (the layout: tp, pp)."""
    local = tmp / f"local-{run_id}-{step}"
    local.mkdir(parents=True)
    for name, content in files.items():
        torch.save(content, local / name)
    ckpts = CheckpointStore(str(store), run_id)
    ckpts.commit(step, str(local), tokens_seen=step * 128, data_cursor=step, extra=extra)
    return ckpts


def tp_files(shards: list[dict], edit: Callable[[list[dict]], None] = lambda s: None
             ) -> dict[str, object]:
    """The files of a TP checkpoint, `edit` applied to the shards first."""
    edit(shards)
    return {shard_file(r): {"module": shard} for r, shard in enumerate(shards)}


def pp_files(layers: list[dict], edit: Callable[[list[dict]], None] = lambda s: None
             ) -> dict[str, object]:
    """The files of a pipeline checkpoint, `edit` applied to the layers first (a layer
    set to None is left out)."""
    edit(layers)
    return {layer_file(i): layer for i, layer in enumerate(layers) if layer is not None}


def promote_model(store: Path, spec, model: torch.nn.Module, tmp: Path, step: int = 4
                  ) -> CheckpointStore:
    """Run `spec.run_id` claimed with `spec`, `model` committed at `step` as a one-rank
    segment writes it (`{"module": state_dict}`) and promoted."""
    from storage.runs import claim_run

    claim_run(str(store), spec.run_id, spec.spec_hash(), spec.to_dict())
    ckpts = commit_files(store, spec.run_id, step,
                         {"mp_rank_00_model_states.pt": {"module": model.state_dict()}}, tmp)
    ckpts.promote(step)
    return ckpts
