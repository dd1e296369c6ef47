"""One checkpoint of a segment, from the engine's side: loading a chosen checkpoint into
the engine (`load_checkpoint`: the weights-only unpickler, resharding for fewer nodes), the
loop's `Snapshot` of a step awaiting its durable commit, and uncommitting the corrupt
checkpoints a restore stepped over.

Their owner — resume, commit, rollback, uploads and all their state — is
trainer/checkpoint_manager.py.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import structlog

from common.errors import BadConfig
from storage.checkpoints import CheckpointManifest, CheckpointStore, step_dir
from trainer.context import SegmentContext
from trainer.elastic import load_resharded, resharded, saved_layout
from trainer.pipeline import check_saved_pp, engine_pp, loading
from trainer.safe_load import UnsafeCheckpointFile, as_corrupt
from trainer.state import TrainState, state_file
from trainer.tensor_parallel import check_saved_tp, engine_tp

log = structlog.get_logger(__name__)


@dataclass
class Snapshot:
    """Rank 0's checkpoint of a step from the loop's side, for its `commit` line: when the
    loop paused for it (perf_counter) and when the fast-tier copy was handed to the writer,
    then how long the pause lasted once it is over. The commit arrives on the
    checkpointer's reader thread, after the pause — or during it, when the loop waits for
    the durable copy (storage.async_upload off): then the pause so far, which that commit
    ends."""

    began: float
    handed: float = field(default_factory=time.time)
    pause_s: float | None = None

    def stall_s(self) -> float:
        pause = self.pause_s if self.pause_s is not None else time.perf_counter() - self.began
        return round(pause, 4)

    def lag_s(self) -> float:
        return round(max(0.0, time.time() - self.handed), 4)


def load_checkpoint(ctx: SegmentContext, engine, step: int, tier: str,
                    man: CheckpointManifest | None) -> TrainState:
    """Load one chosen checkpoint into the engine on this rank; CorruptCheckpoint when a file
    is missing, fails its checksum, or is refused by the weights-only unpickler. Layouts
    `ckpt/step-X/` (fast tier) and `restore-rank{r}/step-X/` are DeepSpeed's `load_dir/tag/`."""
    root = os.path.join(ctx.workdir, f"restore-rank{ctx.rank}")
    tag = step_dir(step)
    if tier == "fast":
        root = ctx.fast_store.root
        man = man or ctx.fast_store.manifest(step)
    elif ctx.rank != 0:
        man = ctx.store.fetch(step, os.path.join(root, tag))
    if man.config_hash != ctx.config_hash:
        log.warning("checkpoint_config_differs", step=step, checkpoint=man.config_hash,
                    spec=ctx.config_hash)
    saved_world, zero_stage = saved_layout(man.extra, step, ctx.world)
    check_saved_tp(man.extra, step, engine_tp(engine))
    check_saved_pp(man.extra, step, engine_pp(engine))
    try:
        if saved_world != ctx.world and zero_stage in (1, 2):
            # fewer nodes (elastic): DeepSpeed reshards its universal form of the ZeRO state
            load_path = load_resharded(engine, root, tag, os.path.join(
                ctx.workdir, f"universal-rank{ctx.rank}"))
        else:
            with loading(engine):  # a pipeline's tied embedding: broadcast unrecorded
                load_path, _ = engine.load_checkpoint(root, tag=tag)
        state = TrainState.load(os.path.join(root, tag, state_file(ctx.rank)))
    except UnsafeCheckpointFile as exc:
        raise as_corrupt(step, exc) from None
    except RuntimeError as exc:
        if not any(m in str(exc) for m in ("size mismatch", "key(s) in state_dict")):
            raise  # not a config problem: let the supervisor retry
        raise BadConfig("model", f"checkpoint step {step} does not fit this model ({exc})",
                        "resume with the model config the run started with, or use a new run_id"
                        ) from None
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint under {root}/{tag}")
    if state.step != step:
        raise RuntimeError(f"train state says step {state.step}, manifest says {step}")
    state.restore_rng()
    return resharded(state, saved_world, ctx.world)


def drop_corrupt_newer(store: CheckpointStore, corrupt: list[int], restored: int) -> None:
    """Uncommit durable checkpoints found corrupt above the one restored: the replay commits
    those step numbers again, and a corrupt manifest left there would make that commit a
    no-op (commit is idempotent per step). Only once a good older one has loaded."""
    for step in sorted({s for s in corrupt if s > restored}, reverse=True):
        log.warning("corrupt_checkpoint_uncommitted", step=step, restored=restored)
        store.delete(step)
