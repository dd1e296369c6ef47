"""A segment on fewer nodes than the spec asks for (`train.min_nodes`, docs/multinode.md):
the same global batch, by accumulating nodes / nodes-used times more per step. Pure.

The checkpoint it resumes from was written at the larger world size: the train state's
data cursor is rescaled on load (`resharded`) and DeepSpeed reshards the ZeRO <= 2
optimizer state (`load_resharded`); trainer/checkpointing.py calls both.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from fractions import Fraction

from common.errors import BadConfig
from spec import RunSpec
from trainer.state import TrainState


def on_nodes(spec: RunSpec, nnodes: int) -> RunSpec:
    """`spec` as a segment on `nnodes` nodes runs it (itself when nnodes == train.nodes)."""
    t = spec.train
    if nnodes == t.nodes:
        return spec
    if nnodes not in t.node_counts():
        raise BadConfig("--nnodes", f"{nnodes} nodes for a spec of train.nodes={t.nodes}, "
                        f"min_nodes={t.min_nodes}", f"use one of {t.node_counts()}")
    train = dataclasses.replace(t, nodes=nnodes, min_nodes=0,
                                grad_accum=t.grad_accum * (t.nodes // nnodes))
    return dataclasses.replace(spec, train=train)


def resharded(state: TrainState, saved_world: int, world: int) -> TrainState:
    """Pure: the train state of a checkpoint written at `saved_world` ranks, read at
    `world`. The data cursor counts one rank's micro-batches (rank r of world W reads
    samples (cursor x W + r) x batch), so the same global samples come next at cursor x
    saved_world / world; skip ranges likewise."""
    if saved_world == world:
        return state
    scale = Fraction(saved_world, world)
    if (state.data_cursor * scale).denominator != 1:
        raise RuntimeError(f"data cursor {state.data_cursor} at world size {saved_world} "
                           f"is not a whole cursor at world size {world}")
    return dataclasses.replace(
        state, data_cursor=int(state.data_cursor * scale),
        skip_ranges=[(int(a * scale), int(b * scale)) for a, b in state.skip_ranges])


def load_resharded(engine, root: str, tag: str, scratch: str) -> str | None:
    """Load a ZeRO-1/2 checkpoint written at another data-parallel world size: DeepSpeed's
    own converter (`deepspeed.checkpoint.ds_to_universal`, with the state a non-Megatron
    client lacks injected) turns `root/tag` into its universal form under `scratch`, which
    the engine loads resharded to this world. A conversion that fails raises (the
    supervisor retries; the checkpoint itself is untouched). Returns the path loaded."""
    shutil.rmtree(scratch, ignore_errors=True)
    src, dst = os.path.join(root, tag), os.path.join(scratch, tag)
    os.makedirs(scratch, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                           "--input_folder", src, "--output_folder", dst,
                           "--num_extract_workers", "1", "--num_merge_workers", "1",
                           "--inject_missing_state"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"resharding {src} (ds_to_universal) failed: "
                           f"{(done.stderr or done.stdout)[-800:]}")
    was = engine._config.load_universal_checkpoint  # DeepSpeed reads its config here
    engine._config.load_universal_checkpoint = True
    try:
        load_path, _ = engine.load_checkpoint(scratch, tag=tag)
    finally:
        engine._config.load_universal_checkpoint = was
    return load_path
