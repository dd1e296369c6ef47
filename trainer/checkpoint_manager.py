"""The segment's checkpoints and all of their state, in one owner: `CheckpointManager`.

The step loop (trainer/loop.py) asks it for three things only: `maybe_save(state, last=…)`
after every step, `rollback_to(step)` when a verdict asks for one (trainer/guard.py), and
`finish()` at the segment's end. The segment start-up asks for `restore()` (or an
operator's `rollback_to`) and, on a fresh run, `save()` of step 0 as the rollback base.

What it owns: rank 0's tiered checkpointer (fast tier now, durable upload in its writer
process, manifest last), the durable commit announced last (`last_commit`) with the lock
that keeps it and its `commit` progress line together, the loop's snapshots awaiting their
durable commit, the corrupt checkpoints skipped on the way to a restore, the loop's
checkpoint pauses (`stall_s`, `stalls`: the cost train.checkpoint_every "auto" weighs), and
the step saved or restored last, which no `maybe_save` commits a second time.

Loading one checkpoint into the engine is trainer/checkpointing.py.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable

import structlog
import torch
import torch.distributed as dist
from opentelemetry import trace

from common.errors import StorageUnavailable
from common.protocol import CommitLine
from spec.layout import pp_degree, tp_degree
from storage.checkpoints import (
    CheckpointManifest,
    CorruptCheckpoint,
    corrupt_fault_id,
    emit_corrupt,
    step_dir,
)
from storage.retention import spike_reach
from storage.rollback import roll_back
from storage.tiered import TieredCheckpointer, TierPolicy
from trainer import tracing
from trainer.checkpointing import Snapshot, drop_corrupt_newer, load_checkpoint
from trainer.context import SegmentContext
from trainer.state import TrainState, state_file

log = structlog.get_logger(__name__)


def layout_extra(ctx: SegmentContext) -> dict[str, int]:
    """What a checkpoint's manifest says of the layout it was written at, for its readers:
    the world size and ZeRO stage (trainer/elastic.py `saved_layout`) and, with TP, the
    degree its shards need (trainer/tensor_parallel.py `check_saved_tp`; left out at 1, as
    in every manifest written before TP); with PP, its stages (trainer/pipeline.py
    `check_saved_pp`; likewise left out at 1)."""
    extra = {"world_size": ctx.world, "zero_stage": ctx.spec.train.zero_stage}
    if (tp := tp_degree(ctx.spec.train.layout)) > 1:
        extra["tp"] = tp
    if (pp := pp_degree(ctx.spec.train.layout)) > 1:
        extra["pp"] = pp
    return extra


def save_due(step: int, saved: int | None, every: int, last: bool) -> bool:
    """Whether the loop commits `step`: every `every` steps and at its last step, never a
    step saved or restored already (a rollback's restored step, an early stop on one)."""
    return step != saved and (last or step % every == 0)


class CheckpointManager:
    """Resume, commit, roll back and drain the checkpoints of one segment (every rank)."""

    def __init__(self, ctx: SegmentContext, engine, every: int) -> None:
        self.ctx, self.engine, self.every = ctx, engine, every
        self.last_commit: tuple[int, str] | None = None  # (step, uri), durable, announced
        self.restored: tuple[int, str] | None = None  # (step, tier) of the last restore
        self.saved_step: int | None = None  # the newest step saved or restored here
        self.stall_s, self.stalls = 0.0, 0  # the loop's checkpoint pauses: total, count
        self._checkpointer: TieredCheckpointer | None = None
        self._snapshots: dict[int, Snapshot] = {}  # rank 0: step -> its snapshot, until durable
        self._corrupt_seen: list[tuple[int, float]] = []  # (step, when) skipped as corrupt
        self._commit_lock = threading.Lock()  # last_commit and its commit line, together
        self._announcer: threading.Thread | None = None

    @property
    def last_committed_step(self) -> int | None:
        return self.last_commit[0] if self.last_commit else None

    # ---- the loop's calls --------------------------------------------------------------
    def maybe_save(self, state: TrainState, *, last: bool = False) -> bool:
        """Commit `state` when its step is due (`save_due`); `last`: the loop's last step,
        so an early stop ends on a committed step. Every rank calls it at every step."""
        if not self.due(state, last=last):
            return False
        self.save(state)
        return True

    def due(self, state: TrainState, *, last: bool = False) -> bool:
        """Whether `maybe_save` commits `state` (`save_due`)."""
        return save_due(state.step, self.saved_step, self.every, last)

    def save(self, state: TrainState) -> None:
        """Save on every rank to the fast tier (the loop's only pause); rank 0 then hands the
        snapshot to the writer process, which commits it durably (manifest last) and only
        then writes the `commit` progress line and the checkpoint_committed event.
        With `storage.async_upload` off, waits here for that durable commit."""
        self.ctx.windows.close()  # the steps since the last checkpoint: one span
        with tracing.span(f"checkpoint stage {state.step}", badput="checkpoint_stall",
                          step=state.step, rank=self.ctx.rank):
            self._commit(state)  # spans leave in the exporter's thread, not this pause
        self.saved_step = state.step

    def rollback_to(self, at_or_before: int) -> tuple[TrainState | None, list[int]]:
        """A rollback (spike or operator): restore the newest good checkpoint at or before
        `at_or_before` first, and only once it has loaded uncommit every newer one on both
        tiers — they hold the abandoned trajectory, and the replay commits those step
        numbers again (storage/rollback.py). Rank 0 first records the new lineage on the
        durable tier, so no copy of the abandoned one on another machine's fast tier is
        resumed or uploaded later. Waits for in-flight uploads first so none lands after
        the uncommit. (None, []) when no checkpoint is left there: nothing is deleted."""
        ctx = self.ctx
        if ctx.leader:  # every node's uploads in, before rank 0 uncommits
            self._tiered().drain()
        stores = [ctx.store, ctx.fast_store] if ctx.rank == 0 else []
        return roll_back(at_or_before, lambda bound: self.restore(bound),
                         lambda state: state.step, stores,
                         branch=self._tiered().branch if ctx.rank == 0 else None)

    def finish(self) -> None:
        """Segment end: the restored step's announcement written, then every snapshot
        durable (StorageUnavailable on timeout)."""
        self._settle()
        if self._checkpointer is not None:
            try:
                self._checkpointer.drain()
            finally:
                self._checkpointer.close()

    # ---- resume ------------------------------------------------------------------------
    def restore(self, at_or_before: int | None = None) -> TrainState | None:
        """Load the newest good checkpoint at or before `at_or_before` (default: the
        segment's target step) into the engine; None if there is none.

        Rank 0 picks it from either tier (TieredCheckpointer.resume: fast copies verified
        in place, durable ones verified while fetched, corrupt ones reported and skipped)
        and broadcasts (step, tier). Every rank then loads it with the weights-only
        unpickler (trainer/safe_load.py): a file that carries code, or any rank failing to
        load, makes it corrupt too — reported, and the next older one is tried.
        """
        ctx = self.ctx
        bound = ctx.target if at_or_before is None else at_or_before
        corrupt: list[int] = []  # steps found corrupt on the durable tier while choosing
        while True:
            pick, man = self._choose(bound, corrupt)
            if pick is None:
                return None
            try:
                state, problem = load_checkpoint(ctx, self.engine, *pick, man), None
            except CorruptCheckpoint as exc:
                state, problem = None, exc
            if not ctx.any_rank(problem is not None):
                break
            step, tier = pick
            if ctx.rank == 0:
                self._report_corrupt(problem or CorruptCheckpoint(
                    step, "(another rank's files)", "loadable", "another rank could not load it"))
                if tier == "fast":  # its durable copy, if there is one, is tried next
                    ctx.fast_store.delete(step)
                else:
                    corrupt.append(step)
            if tier != "fast":
                bound = step - 1
        shutil.rmtree(os.path.join(ctx.workdir, f"restore-rank{ctx.rank}"), ignore_errors=True)
        self.restored, self.saved_step = pick, state.step
        trace.get_current_span().set_attributes({"step": pick[0], "tier": pick[1],
                                                 "bytes": man.total_bytes if man else 0})
        if ctx.rank == 0:
            self._recovered_from_corrupt(state.step)
            drop_corrupt_newer(ctx.store, corrupt, state.step)
            self._tiered().last_step = state.step
            self.last_commit = None
            self._in_background(lambda: self._announce_durable(state.step))
        return state

    def _choose(self, bound: int, corrupt: list[int]
                ) -> tuple[tuple[int, str] | None, CheckpointManifest | None]:
        """Rank 0 picks the newest verified checkpoint at or before `bound`; all ranks learn
        (step, tier). Rank 0 also gets its manifest (a durable one is fetched while
        verified)."""
        ctx = self.ctx
        root = os.path.join(ctx.workdir, f"restore-rank{ctx.rank}")
        shutil.rmtree(root, ignore_errors=True)
        pick, man = None, None
        if ctx.rank == 0:
            def on_corrupt(exc: CorruptCheckpoint) -> None:
                self._report_corrupt(exc)
                corrupt.append(exc.step)

            # a node's fast tier holds its own ranks' files only: multi-node resumes are durable
            found = self._tiered().resume(root, at_or_before=bound, on_corrupt=on_corrupt,
                                          fast=not ctx.args.session)
            if found:
                man, _, tier = found
                pick = (man.step, tier)
        if ctx.world > 1:
            box = [pick]
            dist.broadcast_object_list(box, src=0)
            pick = box[0]
        return pick, man

    def _report_corrupt(self, exc: CorruptCheckpoint) -> None:
        emit_corrupt(self.ctx.events, exc)
        self.ctx.events.flush()
        self._corrupt_seen.append((exc.step, time.time()))

    def _recovered_from_corrupt(self, restored: int) -> None:
        """Each corrupt checkpoint skipped on the way to `restored`: recovered by loading it."""
        events = self.ctx.events
        for step, seen in self._corrupt_seen:
            events.emit("recovered", step=restored, event_id=f"recovered/{corrupt_fault_id(step)}",
                        fault_event_id=corrupt_fault_id(step), resumed_step=restored,
                        lost_steps=max(0, step - restored), detection_s=0.0, restart_s=0.0,
                        restore_s=round(time.time() - seen, 3),
                        mttr_s=round(time.time() - seen, 3), attempt=self.ctx.args.attempt)
        if self._corrupt_seen:
            events.flush()
        self._corrupt_seen.clear()

    def _announce_durable(self, step: int) -> None:
        """Heartbeats carry durable commits only: the newest one at or before the restored
        step. A kill between manifest and event flush loses only the newest commit's event;
        announcing it again is idempotent (same event_id). A corrupt one is not announced.
        It runs beside the first steps — a listing, a manifest and an event flush take up
        to 1.8 s on a loaded S3 — and stands back when the checkpointer committed a newer
        step meanwhile."""
        store = self.ctx.store
        for durable in reversed(store.list_committed()):
            if durable > step:
                continue
            try:
                man = store.manifest(durable)
            except CorruptCheckpoint:
                continue
            with self._commit_lock:
                if self.last_commit is None:
                    self._committed(man, store.uri(durable))
            return

    def _in_background(self, work: Callable[[], None]) -> None:
        """Run `work` in a thread of its own, after the previous one."""
        self._settle()

        def run() -> None:
            try:
                work()
            except Exception as exc:  # noqa: BLE001 — the next commit announces itself
                log.warning("background_work_failed", error=repr(exc)[:300])
        self._announcer = threading.Thread(target=run, name="mainspring-announce", daemon=True)
        self._announcer.start()

    def _settle(self) -> None:
        if self._announcer is not None:
            self._announcer.join()
            self._announcer = None

    # ---- commit ------------------------------------------------------------------------
    def _tiered(self) -> TieredCheckpointer:
        """A node leader's checkpointer (its writer process uploads the node's files): fast
        tier → durable store, made on first use — in the main thread, which the writer's
        parent-death signal is tied to. The writer's cleanup (the newest durable copy and
        what is uploading stay) bounds the fast tier across segments. On a multi-node
        segment the other nodes' writers upload their ranks' files as parts and rank 0's
        commits the one manifest once every part of the launch (`session`) is durable."""
        ctx = self.ctx
        if self._checkpointer is None:
            self._checkpointer = TieredCheckpointer(
                ctx.store, ctx.fast_store, TierPolicy.from_storage(
                    ctx.spec.storage, spike_reach(ctx.spec.spikes.window)
                    if ctx.spec.spikes.enabled else 0),
                events=ctx.events, on_commit=self._on_durable_commit if ctx.rank == 0 else None,
                node_rank=ctx.node_rank, nnodes=ctx.nnodes, session=ctx.args.session)
        return self._checkpointer

    def _on_durable_commit(self, man: CheckpointManifest, uri: str) -> None:
        """The checkpointer's reader thread, once the writer process has written the durable
        manifest: only now is it committed."""
        with self._commit_lock:  # one at a time with a restore's announcement
            self._committed(man, uri)

    def _committed(self, man: CheckpointManifest, uri: str) -> None:
        events = self.ctx.events
        events.emit("checkpoint_committed", step=man.step,
                    event_id=f"checkpoint_committed/{man.step}", uri=uri, bytes=man.total_bytes)
        try:
            events.flush()
        except StorageUnavailable as exc:  # the batch stays buffered for the next flush
            log.warning("event_flush_deferred", step=man.step, error=exc.cause[:200])
        self.last_commit = (man.step, uri)
        snap = self._snapshots.pop(man.step, None)  # None: announced again at a restore
        self.ctx.progress.write(CommitLine(step=man.step, uri=uri, bytes=man.total_bytes,
                                           stall_s=snap.stall_s() if snap else None,
                                           upload_lag_s=snap.lag_s() if snap else None))

    def _commit(self, state: TrainState) -> None:
        ctx, t0 = self.ctx, time.perf_counter()
        fast, tag = ctx.fast_store, step_dir(state.step)
        if ctx.leader:  # each node's fast tier
            self._tiered().prepare(state.step)  # clears a partial save from an earlier attempt
        ctx.barrier()
        failure = None
        try:
            self.engine.save_checkpoint(fast.root, tag=tag, save_latest=False)
            state.save(os.path.join(fast.path(state.step), state_file(ctx.rank)))
        except (OSError, RuntimeError) as exc:  # disk full / I/O error (torch wraps OSError)
            failure = exc
        # collective: every rank learns whether any failed to write
        failed_ranks = ctx.mean_over_ranks(torch.tensor(float(failure is not None))) * ctx.world
        if failed_ranks > 0:
            if ctx.rank == 0:
                raise self._tiered().write_failed(state.step, failure or RuntimeError(
                    f"{failed_ranks:.0f} other rank(s) failed to write the fast tier"))
            raise StorageUnavailable(fast.url, f"writing step {state.step} failed: {failure!r}")
        if not ctx.leader:
            return
        ckpt = self._tiered()
        snap = Snapshot(t0) if ctx.rank == 0 else None
        if snap is not None:
            self._snapshots[state.step] = snap  # a rollback's replay of the step replaces it
        waited = ckpt.submit(
            state.step, tokens_seen=state.tokens_seen, data_cursor=state.data_cursor,
            skip_ranges=tuple(tuple(r) for r in state.skip_ranges), detector_state=state_file(0),
            config_hash=ctx.config_hash, parent=ckpt.last_step,
            writer=f"trainer-attempt{ctx.args.attempt}",
            extra=layout_extra(ctx))
        if not ctx.spec.storage.async_upload:
            ckpt.drain()
        pause = time.perf_counter() - t0
        self.stall_s, self.stalls = self.stall_s + pause, self.stalls + 1
        if snap is not None:
            snap.pause_s = pause
        if ctx.events is None:  # another node's leader: rank 0 records the checkpoint
            return
        ctx.events.emit("checkpoint_saved", step=state.step, tier="fast",
                        pause_s=round(pause, 4), waited_s=round(waited, 4),
                        event_id=f"checkpoint_saved/{state.step}/{ctx.args.launch}")
        log.info("checkpoint_pause", step=state.step, seconds=round(pause, 3))
