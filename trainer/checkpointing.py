"""Segment plumbing: the Run context (spec, rank, store, progress file) and the checkpoint
path — resume from the newest verified checkpoint on either tier, and commit through the
tiered checkpointer (fast tier now, durable upload in the background, manifest last).

Split from `trainer/segment.py` so the entry point reads as: set up, restore, step loop.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch
import torch.distributed as dist

from common.errors import BadConfig, MainspringError, StorageUnavailable
from common.procs import stop_requested
from spec import RunSpec
from storage.checkpoints import (
    CheckpointManifest,
    CheckpointStore,
    CorruptCheckpoint,
    emit_corrupt,
    step_dir,
)
from storage.events import EventLog
from storage.retention import spike_reach
from storage.rollback import roll_back
from storage.tiered import TieredCheckpointer, TierPolicy
from trainer.safe_load import UnsafeCheckpointFile, as_corrupt
from trainer.state import TrainState, state_file

log = structlog.get_logger(__name__)

EXIT_BAD_INPUT = 3  # BadConfig / BadData, error.json written: non-retryable
EXIT_STORAGE = 4  # StorageUnavailable, error.json written: retryable


# ---- small helpers -------------------------------------------------------------------
def write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"  # ranks may write the same file
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def run_classified(name: str, workdir: str, body) -> int:
    """Run a child entry point's body; map failures to the supervisor's contract (the one
    classification path of every trainer child: segment, evaluate, export).

    A MainspringError -> error.json naming its kind and retryability, then exit 3 when it
    will repeat (BadConfig, BadData, Diverged, ...: not retried), 4 for StorageUnavailable,
    1 for other retryable ones; anything else -> exit 1 (a retryable HardwareFault).
    """
    try:
        body()
    except MainspringError as exc:
        log.error("entry_point_failed", entry=name, kind=exc.kind, message=str(exc),
                  retryable=exc.retryable)
        write_json(os.path.join(workdir, "error.json"),
                   {"type": exc.kind, "message": str(exc), "retryable": exc.retryable})
        if isinstance(exc, StorageUnavailable):
            return EXIT_STORAGE
        return 1 if exc.retryable else EXIT_BAD_INPUT
    except Exception:  # logged; the supervisor classifies the exit code
        log.exception("entry_point_crashed", entry=name)
        return 1
    return 0


def load_spec(path: str) -> RunSpec:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise BadConfig("--spec", f"cannot read {path}: {exc}", "pass a RunSpec JSON file") from None
    return RunSpec.from_dict(raw)


class Progress:
    """Rank 0's append-only progress file, flushed per line so the supervisor can tail it."""

    def __init__(self, path: str | None) -> None:
        self.path, self.f = path, None

    def write(self, kind: str, **fields: Any) -> None:
        if self.path is None:
            return
        if self.f is None:
            self.f = open(self.path, "a")
        self.f.write(json.dumps({"type": kind, **fields, "ts": time.time()}) + "\n")
        self.f.flush()


SIGNALLED: list[str] = []  # appended to by on_sigterm


def on_sigterm(signum: int, frame: object) -> None:
    """A preemption notice (SLURM, Kubernetes send SIGTERM before SIGKILL): stop at the end
    of the current step with a checkpoint instead of dying mid-step."""
    SIGNALLED.append("SIGTERM (preemption notice)")


class Run:
    """What one segment process knows: spec, rank, store, and rank 0's outputs."""

    def __init__(self, args: argparse.Namespace, spec: RunSpec, rank: int, world: int) -> None:
        self.args, self.spec, self.rank, self.world = args, spec, rank, world
        self.workdir, self.target = args.workdir, args.to_step
        self.store = CheckpointStore(spec.storage.durable, spec.run_id)
        self.events = None
        if rank == 0:
            traceparent = os.environ.get("TRACEPARENT", "")
            trace_id = traceparent.split("-")[1] if traceparent.count("-") >= 3 else ""
            self.events = EventLog(spec.storage.durable, spec.run_id, "trainer",
                                   attempt=args.attempt, trace_id=trace_id)
        self.progress = Progress(os.path.join(self.workdir, "progress.jsonl") if rank == 0 else None)
        self.last_commit: tuple[int, str] | None = None  # (step, uri)

    def comm_device(self) -> torch.device:
        """Where a collective's tensor must live: the current GPU under NCCL, else the CPU."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def loss_and_stop(self, loss: torch.Tensor) -> tuple[float, str]:
        """The step's one collective: the mean loss over ranks, and why to stop after this
        step ('' to go on) — SIGTERM (a preemption notice) on any rank, or the supervisor's
        stop file, which rank 0 reads — so that every rank stops at the same step."""
        reason = SIGNALLED[-1] if SIGNALLED else (stop_requested(self.workdir) if self.rank == 0 else "")
        if self.world == 1:
            return float(loss), reason
        both = torch.stack([loss.detach().float().reshape(()),
                            torch.tensor(1.0 if reason else 0.0)]).to(self.comm_device())
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        if not reason and float(both[1]) > 0:
            reason = "stop requested on another rank"
        return float(both[0] / self.world), reason

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def from_rank0(self, read: Callable[[], Any]) -> Any:
        """`read()` on rank 0 (storage reads, once per job), broadcast to every rank."""
        box = [read() if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (one collective)."""
        if self.world == 1:
            return flag
        return self.mean_over_ranks(torch.tensor(float(flag))) > 0

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        if self.world > 1:
            value = value.detach().float().to(self.comm_device())
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            value /= self.world
        return float(value)


# ---- resume and commit -----------------------------------------------------------------
def _fast_store(run: Run) -> CheckpointStore:
    """The fast tier: the run's local store on this machine (`--fast-dir`, shared by a
    node's ranks and by the run's segments, storage/fast_tier.py), so a retry or the next
    segment on this machine resumes locally and the writer's cleanup — the newest durable
    copy and what is uploading stay — bounds it across segments."""
    if "fast_store" not in run.__dict__:
        run.fast_store = CheckpointStore.local(
            run.args.fast_dir or os.path.join(run.workdir, "ckpt"))
    return run.fast_store


def _checkpointer(run: Run) -> TieredCheckpointer:
    """Rank 0's checkpointer (its writer process uploads): fast tier → durable store, made on
    first use — in the main thread, which the writer's parent-death signal is tied to."""
    if "checkpointer" not in run.__dict__:
        run.checkpointer = TieredCheckpointer(
            run.store, _fast_store(run), TierPolicy.from_storage(
                run.spec.storage, spike_reach(run.spec.spikes.window)
                if run.spec.spikes.enabled else 0),
            events=run.events, on_commit=lambda man, uri: _on_durable_commit(run, man, uri))
    return run.checkpointer


def _on_durable_commit(run: Run, man: CheckpointManifest, uri: str) -> None:
    """The checkpointer's reader thread, once the writer process has written the durable
    manifest: only now is it committed."""
    run.events.emit("checkpoint_committed", step=man.step,
                    event_id=f"checkpoint_committed/{man.step}", uri=uri, bytes=man.total_bytes)
    try:
        run.events.flush()
    except StorageUnavailable as exc:  # the batch stays buffered for the next flush
        log.warning("event_flush_deferred", step=man.step, error=exc.cause[:200])
    run.last_commit = (man.step, uri)
    # One O_APPEND write per line: atomic next to the loop's own appends to this file.
    line = json.dumps({"type": "commit", "step": man.step, "uri": uri,
                       "bytes": man.total_bytes, "ts": time.time()}) + "\n"
    fd = os.open(os.path.join(run.workdir, "progress.jsonl"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def finish_uploads(run: Run) -> None:
    """Segment end: wait until every snapshot is durable (StorageUnavailable on timeout)."""
    ckpt = run.__dict__.get("checkpointer")
    if ckpt is not None:
        try:
            ckpt.drain()
        finally:
            ckpt.close()


def restore(run: Run, engine, at_or_before: int | None = None) -> TrainState | None:
    """Load the newest good checkpoint at or before `at_or_before` (default: the segment's
    target step) into the engine; None if there is none. Also used mid-segment by a rollback.

    Rank 0 picks it from either tier (TieredCheckpointer.resume: fast copies verified in
    place, durable ones verified while fetched, corrupt ones reported and skipped) and
    broadcasts (step, tier). Every rank then loads it with the weights-only unpickler
    (trainer/safe_load.py): a file that carries code, or any rank failing to load, makes
    it corrupt too — reported, and the next older one is tried. Layouts `ckpt/step-X/`
    (fast tier) and `restore-rank{r}/step-X/` are DeepSpeed's `load_dir/tag/`.
    """
    bound = run.target if at_or_before is None else at_or_before
    corrupt: list[int] = []  # steps found corrupt on the durable tier while choosing
    while True:
        pick, man = _choose(run, bound, corrupt)
        if pick is None:
            return None
        try:
            state, problem = _load(run, engine, *pick, man), None
        except CorruptCheckpoint as exc:
            state, problem = None, exc
        if not run.any_rank(problem is not None):
            break
        step, tier = pick
        if run.rank == 0:
            _report_corrupt(run, problem or CorruptCheckpoint(
                step, "(another rank's files)", "loadable", "another rank could not load it"))
            if tier == "fast":  # its durable copy, if there is one, is tried next
                _fast_store(run).delete(step)
            else:
                corrupt.append(step)
        if tier != "fast":
            bound = step - 1
    shutil.rmtree(os.path.join(run.workdir, f"restore-rank{run.rank}"), ignore_errors=True)
    if run.rank == 0:
        _drop_corrupt_newer(run, corrupt, state.step)
        run.checkpointer.last_step = state.step
        _announce_durable(run, state.step)
    return state


def _announce_durable(run: Run, step: int) -> None:
    """Heartbeats carry durable commits only: the newest one at or before the restored step.
    A kill between manifest and event flush loses only the newest commit's event; announcing
    it again is idempotent (same event_id). A corrupt one is not announced."""
    run.last_commit = None
    for durable in reversed(run.store.list_committed()):
        if durable > step:
            continue
        try:
            man = run.store.manifest(durable)
        except CorruptCheckpoint:
            continue
        _on_durable_commit(run, man, run.store.uri(durable))
        return


def _report_corrupt(run: Run, exc: CorruptCheckpoint) -> None:
    emit_corrupt(run.events, exc)
    run.events.flush()


def _choose(run: Run, bound: int, corrupt: list[int]
            ) -> tuple[tuple[int, str] | None, CheckpointManifest | None]:
    """Rank 0 picks the newest verified checkpoint at or before `bound`; all ranks learn
    (step, tier). Rank 0 also gets its manifest (a durable one is fetched while verified)."""
    root = os.path.join(run.workdir, f"restore-rank{run.rank}")
    shutil.rmtree(root, ignore_errors=True)
    pick, man = None, None
    if run.rank == 0:
        def on_corrupt(exc: CorruptCheckpoint) -> None:
            _report_corrupt(run, exc)
            corrupt.append(exc.step)

        found = _checkpointer(run).resume(root, at_or_before=bound, on_corrupt=on_corrupt)
        if found:
            man, _, tier = found
            pick = (man.step, tier)
    if run.world > 1:
        box = [pick]
        dist.broadcast_object_list(box, src=0)
        pick = box[0]
    return pick, man


def _load(run: Run, engine, step: int, tier: str, man: CheckpointManifest | None
          ) -> TrainState:
    """Load one chosen checkpoint into the engine on this rank; CorruptCheckpoint when a file
    is missing, fails its checksum, or is refused by the weights-only unpickler."""
    root = os.path.join(run.workdir, f"restore-rank{run.rank}")
    tag = step_dir(step)
    if tier == "fast":
        root = _fast_store(run).root
        man = man or _fast_store(run).manifest(step)
    elif run.rank != 0:
        man = run.store.fetch(step, os.path.join(root, tag))
    if man.config_hash != run.spec.spec_hash():
        log.warning("checkpoint_config_differs", step=step, checkpoint=man.config_hash,
                    spec=run.spec.spec_hash())
    try:
        load_path, _ = engine.load_checkpoint(root, tag=tag)
        state = TrainState.load(os.path.join(root, tag, state_file(run.rank)))
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
    return state


def _drop_corrupt_newer(run: Run, corrupt: list[int], restored: int) -> None:
    """Uncommit durable checkpoints found corrupt above the one restored: the replay commits
    those step numbers again, and a corrupt manifest left there would make that commit a
    no-op (commit is idempotent per step). Only once a good older one has loaded."""
    for step in sorted({s for s in corrupt if s > restored}, reverse=True):
        log.warning("corrupt_checkpoint_uncommitted", step=step, restored=restored)
        run.store.delete(step)


def commit_checkpoint(run: Run, engine, state: TrainState) -> None:
    """Save on every rank to the fast tier (the loop's only pause); rank 0 then hands the
    snapshot to the writer process, which commits it durably (manifest last) and only then
    writes the `commit` progress line and the checkpoint_committed event.
    With `storage.async_upload` off, waits here for that durable commit."""
    t0 = time.perf_counter()
    fast = _fast_store(run)
    tag = step_dir(state.step)
    if run.rank == 0:
        _checkpointer(run).prepare(state.step)  # clears a partial save from an earlier attempt
    run.barrier()
    failure = None
    try:
        engine.save_checkpoint(fast.root, tag=tag, save_latest=False)
        state.save(os.path.join(fast.path(state.step), state_file(run.rank)))
    except (OSError, RuntimeError) as exc:  # disk full / I/O error (torch wraps OSError)
        failure = exc
    failed_ranks = run.mean_over_ranks(torch.tensor(float(failure is not None))) * run.world
    if failed_ranks > 0:
        if run.rank == 0:
            raise run.checkpointer.write_failed(state.step, failure or RuntimeError(
                f"{failed_ranks:.0f} other rank(s) failed to write the fast tier"))
        raise StorageUnavailable(fast.url, f"writing step {state.step} failed: {failure!r}")
    if run.rank != 0:
        return
    ckpt = run.checkpointer
    waited = ckpt.submit(
        state.step, tokens_seen=state.tokens_seen, data_cursor=state.data_cursor,
        skip_ranges=tuple(tuple(r) for r in state.skip_ranges), detector_state=state_file(0),
        config_hash=run.spec.spec_hash(), parent=ckpt.last_step,
        writer=f"trainer-attempt{run.args.attempt}",
        extra={"world_size": run.world, "zero_stage": run.spec.train.zero_stage})
    if not run.spec.storage.async_upload:
        ckpt.drain()
    pause = time.perf_counter() - t0
    run.events.emit("checkpoint_saved", step=state.step, tier="fast", pause_s=round(pause, 4),
                    waited_s=round(waited, 4),
                    event_id=f"checkpoint_saved/{state.step}/{run.args.attempt}")
    log.info("checkpoint_pause", step=state.step, seconds=round(pause, 3))


def rollback_to(run: Run, engine, at_or_before: int) -> tuple[TrainState | None, list[int]]:
    """A rollback (spike or operator): restore the newest good checkpoint at or before
    `at_or_before` first, and only once it has loaded uncommit every newer one on both
    tiers — they hold the abandoned trajectory, and the replay commits those step numbers
    again (storage/rollback.py). Waits for in-flight uploads first so none lands after the
    uncommit. (None, []) when no checkpoint is left there: nothing is deleted."""
    stores: list[CheckpointStore] = []
    if run.rank == 0:
        _checkpointer(run).drain()
        stores = [run.store, _fast_store(run)]
    return roll_back(at_or_before, lambda bound: restore(run, engine, bound),
                     lambda state: state.step, stores)
