"""Where a segment starts: a finished segment's retry recognised, an operator's rollback
applied, the newest good checkpoint restored, or — a fresh run — step 0 with every RNG
seeded, never over committed work.
"""

from __future__ import annotations

import random
import time

import numpy as np
import torch

from common.errors import BadData
from storage.checkpoints import CheckpointManifest, CheckpointStore, CorruptCheckpoint
from trainer import operator_rollback, tracing
from trainer.checkpoint_manager import CheckpointManager
from trainer.context import SegmentContext
from trainer.guard import recorded_skip_ranges
from trainer.spikes import merge_ranges
from trainer.state import TrainState


def start_state(ctx: SegmentContext, checkpoints: CheckpointManager
                ) -> tuple[TrainState, float] | None:
    """The state the segment trains from, and the seconds spent restoring it (or finding
    nothing to restore): an operator's rollback applied (once per command id), else the
    newest good checkpoint, else — a fresh run — step 0 with every RNG seeded. None when
    the operator's target is gone."""
    rollback = operator_rollback.pending(ctx, ctx.args.rollback)
    began = time.perf_counter()
    with tracing.span("rollback" if rollback else "restore",
                      badput="rollback" if rollback else "restore", rank=ctx.rank):
        if rollback:
            state, discarded = checkpoints.rollback_to(rollback.to_step)
        else:
            state, discarded = checkpoints.restore(), []
    restore_s = time.perf_counter() - began
    if rollback and state is None:  # retention removed the target after it was admitted
        operator_rollback.refuse(ctx, rollback, ctx.from_rank0(ctx.store.latest_committed))
        return None
    if state is None:
        refuse_fresh_start(ctx)
        seed = ctx.spec.seed + ctx.rank
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        return TrainState(), restore_s
    # the skip windows of rollbacks decided after this checkpoint was written
    state.skip_ranges = merge_ranges(state.skip_ranges + recorded_skip_ranges(ctx))
    if rollback:
        operator_rollback.apply(ctx, state, rollback, discarded)
    return state, restore_s


def finished_manifest(store: CheckpointStore, step: int) -> CheckpointManifest | None:
    """The manifest of `step` when it is committed already (a retry of a finished segment);
    None when it is not, or its manifest is corrupt — then the restore reports it and falls
    back like for any corrupt checkpoint."""
    if store.latest_committed(at_or_before=step) != step:
        return None
    try:
        return store.manifest(step)
    except CorruptCheckpoint:
        return None


def refuse_fresh_start(ctx: SegmentContext) -> None:
    """No loadable checkpoint at or before the target: a fresh start is right only when the
    run has no newer one either — otherwise starting over at step 0 would bury committed
    work (an operator rollback to a step retention had removed once did exactly that)."""
    newer = ctx.from_rank0(lambda: [s for s in ctx.store.list_committed() if s > ctx.target])
    if newer:
        raise BadData(ctx.store.uri(newer[0]), f"no loadable checkpoint at or before step "
                      f"{ctx.target}, but steps {newer[:5]} are committed after it",
                      "see the checkpoint_corrupt events; schedule the segment from a "
                      "committed step (the run's status shows it)")
