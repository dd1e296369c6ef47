"""Checkpoints of a segment: resume from the newest verified checkpoint on either tier,
commit through the tiered checkpointer (fast tier now, durable upload in the background,
manifest last), and roll back (restore first, then uncommit what is newer).

The segment's context (arguments, ranks, collectives, progress file) is trainer/context.py.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

import structlog
import torch
import torch.distributed as dist
from opentelemetry import trace

from common.errors import BadConfig, StorageUnavailable
from common.protocol import CommitLine
from storage.checkpoints import (
    CheckpointManifest,
    CheckpointStore,
    CorruptCheckpoint,
    corrupt_fault_id,
    emit_corrupt,
    step_dir,
)
from storage.retention import spike_reach
from storage.rollback import roll_back
from storage.tiered import TieredCheckpointer, TierPolicy
from trainer import tracing
from trainer.context import SegmentContext
from trainer.elastic import load_resharded, resharded, saved_layout
from trainer.safe_load import UnsafeCheckpointFile, as_corrupt
from trainer.state import TrainState, state_file

log = structlog.get_logger(__name__)


# ---- resume and commit -----------------------------------------------------------------
def _checkpointer(ctx: SegmentContext) -> TieredCheckpointer:
    """A node leader's checkpointer (its writer process uploads the node's files): fast tier
    → durable store, made on first use — in the main thread, which the writer's
    parent-death signal is tied to. The writer's cleanup (the newest durable copy and what
    is uploading stay) bounds the fast tier across segments. On a multi-node segment the
    other nodes' writers upload their ranks' files as parts and rank 0's commits the one
    manifest once every part of the launch (`session`) is durable."""
    if ctx.checkpointer is None:
        ctx.checkpointer = TieredCheckpointer(
            ctx.store, ctx.fast_store, TierPolicy.from_storage(
                ctx.spec.storage, spike_reach(ctx.spec.spikes.window)
                if ctx.spec.spikes.enabled else 0),
            events=ctx.events, on_commit=(lambda man, uri: _on_durable_commit(ctx, man, uri))
            if ctx.rank == 0 else None,
            node_rank=ctx.node_rank, nnodes=ctx.nnodes, session=ctx.args.session)
    return ctx.checkpointer


def _on_durable_commit(ctx: SegmentContext, man: CheckpointManifest, uri: str) -> None:
    """The checkpointer's reader thread, once the writer process has written the durable
    manifest: only now is it committed."""
    with ctx.commit_lock:  # one at a time with a restore's announcement (_announce_durable)
        _committed(ctx, man, uri)


def _committed(ctx: SegmentContext, man: CheckpointManifest, uri: str) -> None:
    ctx.events.emit("checkpoint_committed", step=man.step,
                    event_id=f"checkpoint_committed/{man.step}", uri=uri, bytes=man.total_bytes)
    try:
        ctx.events.flush()
    except StorageUnavailable as exc:  # the batch stays buffered for the next flush
        log.warning("event_flush_deferred", step=man.step, error=exc.cause[:200])
    ctx.last_commit = (man.step, uri)
    snap = ctx.snapshots.pop(man.step, None)  # None: announced again at a restore
    ctx.progress.write(CommitLine(step=man.step, uri=uri, bytes=man.total_bytes,
                                  stall_s=snap.stall_s() if snap else None,
                                  upload_lag_s=snap.lag_s() if snap else None))


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


def finish_uploads(ctx: SegmentContext) -> None:
    """Segment end: wait until every snapshot is durable (StorageUnavailable on timeout)."""
    ckpt = ctx.checkpointer
    if ckpt is not None:
        try:
            ckpt.drain()
        finally:
            ckpt.close()


def restore(ctx: SegmentContext, engine, at_or_before: int | None = None) -> TrainState | None:
    """Load the newest good checkpoint at or before `at_or_before` (default: the segment's
    target step) into the engine; None if there is none. Also used mid-segment by a rollback.

    Rank 0 picks it from either tier (TieredCheckpointer.resume: fast copies verified in
    place, durable ones verified while fetched, corrupt ones reported and skipped) and
    broadcasts (step, tier). Every rank then loads it with the weights-only unpickler
    (trainer/safe_load.py): a file that carries code, or any rank failing to load, makes
    it corrupt too — reported, and the next older one is tried. Layouts `ckpt/step-X/`
    (fast tier) and `restore-rank{r}/step-X/` are DeepSpeed's `load_dir/tag/`.
    """
    bound = ctx.target if at_or_before is None else at_or_before
    corrupt: list[int] = []  # steps found corrupt on the durable tier while choosing
    while True:
        pick, man = _choose(ctx, bound, corrupt)
        if pick is None:
            return None
        try:
            state, problem = _load(ctx, engine, *pick, man), None
        except CorruptCheckpoint as exc:
            state, problem = None, exc
        if not ctx.any_rank(problem is not None):
            break
        step, tier = pick
        if ctx.rank == 0:
            _report_corrupt(ctx, problem or CorruptCheckpoint(
                step, "(another rank's files)", "loadable", "another rank could not load it"))
            if tier == "fast":  # its durable copy, if there is one, is tried next
                ctx.fast_store.delete(step)
            else:
                corrupt.append(step)
        if tier != "fast":
            bound = step - 1
    shutil.rmtree(os.path.join(ctx.workdir, f"restore-rank{ctx.rank}"), ignore_errors=True)
    ctx.restored = pick
    trace.get_current_span().set_attributes({"step": pick[0], "tier": pick[1],
                                             "bytes": man.total_bytes if man else 0})
    if ctx.rank == 0:
        _recovered_from_corrupt(ctx, state.step)
        _drop_corrupt_newer(ctx, corrupt, state.step)
        ctx.checkpointer.last_step = state.step
        ctx.last_commit = None
        ctx.in_background(lambda: _announce_durable(ctx, state.step))
    return state


def _announce_durable(ctx: SegmentContext, step: int) -> None:
    """Heartbeats carry durable commits only: the newest one at or before the restored step.
    A kill between manifest and event flush loses only the newest commit's event; announcing
    it again is idempotent (same event_id). A corrupt one is not announced. It runs beside
    the first steps (a listing, a manifest and an event flush: up to 1.8 s on a loaded S3,
    issue 16), and stands back when the checkpointer committed a newer step meanwhile."""
    for durable in reversed(ctx.store.list_committed()):
        if durable > step:
            continue
        try:
            man = ctx.store.manifest(durable)
        except CorruptCheckpoint:
            continue
        with ctx.commit_lock:
            if ctx.last_commit is None:
                _committed(ctx, man, ctx.store.uri(durable))
        return


def _report_corrupt(ctx: SegmentContext, exc: CorruptCheckpoint) -> None:
    emit_corrupt(ctx.events, exc)
    ctx.events.flush()
    ctx.corrupt_seen.append((exc.step, time.time()))


def _recovered_from_corrupt(ctx: SegmentContext, restored: int) -> None:
    """Each corrupt checkpoint skipped on the way to `restored`: recovered by loading it."""
    for step, seen in ctx.corrupt_seen:
        ctx.events.emit("recovered", step=restored, event_id=f"recovered/{corrupt_fault_id(step)}",
                        fault_event_id=corrupt_fault_id(step), resumed_step=restored,
                        lost_steps=max(0, step - restored), detection_s=0.0, restart_s=0.0,
                        restore_s=round(time.time() - seen, 3),
                        mttr_s=round(time.time() - seen, 3), attempt=ctx.args.attempt)
    if ctx.corrupt_seen:
        ctx.events.flush()
    ctx.corrupt_seen.clear()


def _choose(ctx: SegmentContext, bound: int, corrupt: list[int]
            ) -> tuple[tuple[int, str] | None, CheckpointManifest | None]:
    """Rank 0 picks the newest verified checkpoint at or before `bound`; all ranks learn
    (step, tier). Rank 0 also gets its manifest (a durable one is fetched while verified)."""
    root = os.path.join(ctx.workdir, f"restore-rank{ctx.rank}")
    shutil.rmtree(root, ignore_errors=True)
    pick, man = None, None
    if ctx.rank == 0:
        def on_corrupt(exc: CorruptCheckpoint) -> None:
            _report_corrupt(ctx, exc)
            corrupt.append(exc.step)

        # a node's fast tier holds its own ranks' files only: multi-node resumes are durable
        found = _checkpointer(ctx).resume(root, at_or_before=bound, on_corrupt=on_corrupt,
                                          fast=not ctx.args.session)
        if found:
            man, _, tier = found
            pick = (man.step, tier)
    if ctx.world > 1:
        box = [pick]
        dist.broadcast_object_list(box, src=0)
        pick = box[0]
    return pick, man


def _load(ctx: SegmentContext, engine, step: int, tier: str, man: CheckpointManifest | None
          ) -> TrainState:
    """Load one chosen checkpoint into the engine on this rank; CorruptCheckpoint when a file
    is missing, fails its checksum, or is refused by the weights-only unpickler."""
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
    try:
        if saved_world != ctx.world and zero_stage in (1, 2):
            # fewer nodes (elastic): DeepSpeed reshards its universal form of the ZeRO state
            load_path = load_resharded(engine, root, tag, os.path.join(
                ctx.workdir, f"universal-rank{ctx.rank}"))
        else:
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


def _drop_corrupt_newer(ctx: SegmentContext, corrupt: list[int], restored: int) -> None:
    """Uncommit durable checkpoints found corrupt above the one restored: the replay commits
    those step numbers again, and a corrupt manifest left there would make that commit a
    no-op (commit is idempotent per step). Only once a good older one has loaded."""
    for step in sorted({s for s in corrupt if s > restored}, reverse=True):
        log.warning("corrupt_checkpoint_uncommitted", step=step, restored=restored)
        ctx.store.delete(step)


def commit_checkpoint(ctx: SegmentContext, engine, state: TrainState) -> None:
    """Save on every rank to the fast tier (the loop's only pause); rank 0 then hands the
    snapshot to the writer process, which commits it durably (manifest last) and only then
    writes the `commit` progress line and the checkpoint_committed event.
    With `storage.async_upload` off, waits here for that durable commit."""
    ctx.windows.close()  # the steps since the last checkpoint: one span
    with tracing.span(f"checkpoint stage {state.step}", badput="checkpoint_stall",
                      step=state.step, rank=ctx.rank):
        _commit(ctx, engine, state)  # spans leave in the exporter's thread, not this pause


def _commit(ctx: SegmentContext, engine, state: TrainState) -> None:
    t0 = time.perf_counter()
    fast = ctx.fast_store
    tag = step_dir(state.step)
    if ctx.leader:  # each node's fast tier
        _checkpointer(ctx).prepare(state.step)  # clears a partial save from an earlier attempt
    ctx.barrier()
    failure = None
    try:
        engine.save_checkpoint(fast.root, tag=tag, save_latest=False)
        state.save(os.path.join(fast.path(state.step), state_file(ctx.rank)))
    except (OSError, RuntimeError) as exc:  # disk full / I/O error (torch wraps OSError)
        failure = exc
    failed_ranks = ctx.mean_over_ranks(torch.tensor(float(failure is not None))) * ctx.world
    if failed_ranks > 0:
        if ctx.rank == 0:
            raise ctx.checkpointer.write_failed(state.step, failure or RuntimeError(
                f"{failed_ranks:.0f} other rank(s) failed to write the fast tier"))
        raise StorageUnavailable(fast.url, f"writing step {state.step} failed: {failure!r}")
    if not ctx.leader:
        return
    ckpt = ctx.checkpointer
    snap = Snapshot(t0) if ctx.rank == 0 else None
    if snap is not None:
        ctx.snapshots[state.step] = snap  # a rollback's replay of the step replaces it
    waited = ckpt.submit(
        state.step, tokens_seen=state.tokens_seen, data_cursor=state.data_cursor,
        skip_ranges=tuple(tuple(r) for r in state.skip_ranges), detector_state=state_file(0),
        config_hash=ctx.config_hash, parent=ckpt.last_step,
        writer=f"trainer-attempt{ctx.args.attempt}",
        extra={"world_size": ctx.world, "zero_stage": ctx.spec.train.zero_stage})
    if not ctx.spec.storage.async_upload:
        ckpt.drain()
    pause = time.perf_counter() - t0
    ctx.stall_s, ctx.stalls = ctx.stall_s + pause, ctx.stalls + 1  # "auto" intervals' cost
    if snap is not None:
        snap.pause_s = pause
    if ctx.events is None:  # another node's leader: rank 0 records the checkpoint
        return
    ctx.events.emit("checkpoint_saved", step=state.step, tier="fast", pause_s=round(pause, 4),
                    waited_s=round(waited, 4),
                    event_id=f"checkpoint_saved/{state.step}/{ctx.args.launch}")
    log.info("checkpoint_pause", step=state.step, seconds=round(pause, 3))


def rollback_to(ctx: SegmentContext, engine, at_or_before: int) -> tuple[TrainState | None, list[int]]:
    """A rollback (spike or operator): restore the newest good checkpoint at or before
    `at_or_before` first, and only once it has loaded uncommit every newer one on both
    tiers — they hold the abandoned trajectory, and the replay commits those step numbers
    again (storage/rollback.py). Rank 0 first records the new lineage on the durable tier,
    so no copy of the abandoned one on another machine's fast tier is resumed or uploaded
    later. Waits for in-flight uploads first so none lands after the uncommit. (None, [])
    when no checkpoint is left there: nothing is deleted."""
    stores: list[CheckpointStore] = []
    if ctx.leader:  # every node's uploads in, before rank 0 uncommits
        _checkpointer(ctx).drain()
    if ctx.rank == 0:
        stores = [ctx.store, ctx.fast_store]
    return roll_back(at_or_before, lambda bound: restore(ctx, engine, bound),
                     lambda state: state.step, stores,
                     branch=ctx.checkpointer.branch if ctx.rank == 0 else None)
