"""A segment on fewer nodes than the spec asks for (`train.min_nodes`, docs/multinode.md):
the same global batch, by accumulating nodes / nodes-used times more per step. Pure.

The checkpoint it resumes from was written at the larger world size: the train state's
data cursor is rescaled on load (`resharded`) and DeepSpeed reshards the ZeRO <= 2
optimizer state (`load_resharded`); trainer/checkpointing.py calls both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction

from common.errors import BadConfig
from common.procs import allowed_env, with_repo_on_path
from spec import RunSpec
from storage.manifest import MANIFEST, CorruptCheckpoint
from trainer.load_bounds import bytes_allowed, model_numel
from trainer.safe_load import UnsafeCheckpointFile, safe_torch_load
from trainer.state import TrainState
from trainer.universal import EXIT_REFUSED, REFUSED


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


def saved_layout(extra: dict, step: int, world: int) -> tuple[int, int]:
    """Pure: (world size, ZeRO stage) a checkpoint says it was written at — its manifest's
    `extra`, which whoever writes the bucket writes. Absent: this world, ZeRO 0 (an older
    manifest). Anything but a positive whole number is a corrupt checkpoint, not a crash:
    readers fall back past it."""
    world_size, zero_stage = extra.get("world_size", world), extra.get("zero_stage", 0)
    if type(world_size) is not int or world_size < 1:  # noqa: E721 — a bool is not a size
        raise CorruptCheckpoint(step, MANIFEST, "extra.world_size a positive integer",
                                repr(world_size)[:80])
    if type(zero_stage) is not int or not 0 <= zero_stage <= 3:  # noqa: E721
        raise CorruptCheckpoint(step, MANIFEST, "extra.zero_stage one of 0-3",
                                repr(zero_stage)[:80])
    return world_size, zero_stage


def conversion_command(src: str, dst: str) -> list[str]:
    """DeepSpeed's ds_to_universal behind trainer/universal.py (weights-only loads)."""
    return [sys.executable, "-m", "trainer.universal", "--input_folder", src,
            "--output_folder", dst, "--num_extract_workers", "1", "--num_merge_workers", "1",
            "--inject_missing_state"]


def conversion_env() -> dict[str, str]:
    """The converter's environment: a child's (common/procs.py, weights-only forced)."""
    return with_repo_on_path(allowed_env())


def load_resharded(engine, root: str, tag: str, scratch: str) -> str | None:
    """Load a ZeRO-1/2 checkpoint written at another data-parallel world size: DeepSpeed's
    own converter (`deepspeed.checkpoint.ds_to_universal`, with the state a non-Megatron
    client lacks injected) turns `root/tag` into its universal form under `scratch`, which
    the engine loads resharded to this world. Every file is first read here with the
    bounded weights-only loader, so a refused one names itself (UnsafeCheckpointFile: the
    checkpoint is corrupt); the converter loads weights-only too (trainer/universal.py). A
    conversion that fails otherwise raises RuntimeError (the supervisor retries; the
    checkpoint itself is untouched). Returns the path loaded."""
    shutil.rmtree(scratch, ignore_errors=True)
    src, dst = os.path.join(root, tag), os.path.join(scratch, tag)
    for name in sorted(os.listdir(src)):
        if name.endswith(".pt"):
            safe_torch_load(os.path.join(src, name), map_location="cpu", mmap=True,
                            max_bytes=bytes_allowed(model_numel(engine.module)))
    os.makedirs(scratch, exist_ok=True)
    done = subprocess.run(conversion_command(src, dst), env=conversion_env(),
                          capture_output=True, text=True)
    refused = [ln for ln in done.stdout.splitlines() if ln.startswith(REFUSED)]
    if done.returncode == EXIT_REFUSED and refused:
        raise UnsafeCheckpointFile(src, json.loads(refused[-1][len(REFUSED):])["reason"])
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
