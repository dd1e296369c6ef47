"""`python -m trainer.segment`: train one segment, from the newest committed checkpoint to step B.

Launched by the train_segment supervisor (one process per rank):

    python -m torch.distributed.run --standalone --nproc_per_node W -m trainer.segment \
        --spec SPEC.json --dataset MANIFEST_URI --to-step B --workdir DIR --attempt N

Files in DIR: `progress.jsonl` (rank 0; a `start` line, a `step` line per optimizer step,
a `commit` line per committed checkpoint), `result.json` on success, `error.json` on a
classified failure. Exit codes: 0 done; 3 BadConfig/BadData (non-retryable, error.json);
4 StorageUnavailable (retryable, error.json); anything else is a crash (retryable).
"""

from __future__ import annotations

import os
import sys

from ops.procs import set_parent_death_signal


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when our parent (torchrun, or the worker) dies.

    Runs before torch is imported so there is no window in which an orphaned rank could
    hold a GPU (DESIGN §5). If the parent is already gone we were re-parented to init.
    """
    set_parent_death_signal()
    if os.getppid() == 1:
        sys.exit(1)


if __name__ == "__main__":
    die_with_parent()

# ruff: noqa: E402 — the heavy imports deliberately come after die_with_parent().
import argparse
import json
import math
import random
import shutil
import socket
import time
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist

from ops.errors import BadConfig, BadData, MainspringError, StorageUnavailable
from ops.spec import RunSpec
from storage.checkpoints import CheckpointManifest, CheckpointStore, step_dir
from storage.dataset import load_manifest, read_split
from storage.events import EventLog
from trainer.data import TrainBatches, skip_past
from trainer.faults import due_faults, inject
from trainer.engine import build_engine, lr_at, micro_batch_size, set_lr, tokens_per_step
from trainer.model import GPT
from trainer.state import TrainState, state_file

log = structlog.get_logger(__name__)

EXIT_BAD_INPUT = 3
EXIT_STORAGE = 4


# ---- small helpers -------------------------------------------------------------------
def write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"  # ranks may write the same file
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


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

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        if self.world > 1:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
            value /= self.world
        return float(value)


# ---- resume and commit -----------------------------------------------------------------
def restore(run: Run, engine) -> TrainState | None:
    """Load the newest verified checkpoint at or before the target step; None if there is none.

    Rank 0 picks the step (skipping corrupt ones) and broadcasts it, so every rank loads the
    same checkpoint. Local layout `restore-rank{r}/step-XXXXXXXXX/` is DeepSpeed's
    `load_dir/tag/`, identical to the store's `checkpoints/step-XXXXXXXXX/`.
    """
    root = os.path.join(run.workdir, f"restore-rank{run.rank}")
    shutil.rmtree(root, ignore_errors=True)
    step = None
    if run.rank == 0:
        def on_corrupt(exc) -> None:
            run.events.emit("checkpoint_corrupt", step=exc.step, file=exc.file,
                            event_id=f"checkpoint_corrupt/{exc.step}/{exc.file}",
                            expected=exc.expected, actual=exc.actual)
            run.events.flush()

        man = run.store.fetch_latest(root, at_or_before=run.target, on_corrupt=on_corrupt)
        step = man.step if man else None
    if run.world > 1:
        box = [step]
        dist.broadcast_object_list(box, src=0)
        step = box[0]
    if step is None:
        return None
    tag = step_dir(step)
    if run.rank != 0:
        man = run.store.fetch(step, os.path.join(root, tag))
    if man.config_hash != run.spec.spec_hash():
        log.warning("checkpoint_config_differs", step=step, checkpoint=man.config_hash,
                    spec=run.spec.spec_hash())
    try:
        load_path, _ = engine.load_checkpoint(root, tag=tag)
    except RuntimeError as exc:
        if not any(m in str(exc) for m in ("size mismatch", "key(s) in state_dict")):
            raise  # not a config problem: let the supervisor retry
        raise BadConfig("model", f"checkpoint step {step} does not fit this model ({exc})",
                        "resume with the model config the run started with, or use a new run_id"
                        ) from None
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint under {root}/{tag}")
    state = TrainState.load(os.path.join(root, tag, state_file(run.rank)))
    if state.step != step:
        raise RuntimeError(f"train state says step {state.step}, manifest says {step}")
    state.restore_rng()
    shutil.rmtree(root, ignore_errors=True)
    run.last_commit = (step, run.store.uri(step))
    return state


def commit_checkpoint(run: Run, engine, state: TrainState) -> None:
    """Save on every rank, then rank 0 uploads and writes the manifest (the commit point)."""
    t0 = time.perf_counter()
    ckpt_root = os.path.join(run.workdir, "ckpt")
    tag = step_dir(state.step)
    local = os.path.join(ckpt_root, tag)
    if run.rank == 0:
        shutil.rmtree(local, ignore_errors=True)  # a partial save from an earlier attempt
    run.barrier()
    engine.save_checkpoint(ckpt_root, tag=tag, save_latest=False)
    state.save(os.path.join(local, state_file(run.rank)))
    run.barrier()
    if run.rank != 0:
        return
    parent = run.last_commit[0] if run.last_commit else None
    man: CheckpointManifest = run.store.commit(
        state.step, local, tokens_seen=state.tokens_seen, data_cursor=state.data_cursor,
        skip_ranges=tuple(tuple(r) for r in state.skip_ranges), config_hash=run.spec.spec_hash(),
        parent=parent, writer=f"trainer-attempt{run.args.attempt}",
        extra={"world_size": run.world, "zero_stage": run.spec.train.zero_stage})
    uri = run.store.uri(state.step)
    run.events.emit("checkpoint_committed", step=state.step,
                    event_id=f"checkpoint_committed/{state.step}", uri=uri, bytes=man.total_bytes)
    run.events.flush()
    run.last_commit = (state.step, uri)
    run.progress.write("commit", step=state.step, uri=uri, bytes=man.total_bytes)
    log.info("checkpoint_pause", step=state.step, seconds=round(time.perf_counter() - t0, 3))
    for name in os.listdir(ckpt_root):  # keep only the newest local copy
        if name != tag:
            shutil.rmtree(os.path.join(ckpt_root, name), ignore_errors=True)


# ---- the step loop ---------------------------------------------------------------------
def train(run: Run, engine, batches: TrainBatches, state: TrainState) -> float | None:
    """Optimizer steps from state.step to run.target; commits on schedule. Returns last loss."""
    cfg = run.spec.train
    step_tokens = tokens_per_step(run.spec)
    loss_value = None
    while state.step < run.target:
        t0 = time.perf_counter()
        lr = lr_at(state.step, cfg)
        set_lr(engine, lr)
        loss_sum = torch.zeros((), dtype=torch.float32)
        for _ in range(cfg.grad_accum):  # engine.step() only updates on the last micro-batch
            state.data_cursor = skip_past(state.data_cursor, state.skip_ranges)
            x, y = batches.get(state.data_cursor)
            _, loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            state.data_cursor += 1
            loss_sum += loss.detach().float().cpu()
        state.step += 1
        state.tokens_seen += step_tokens
        loss_value = run.mean_over_ranks(loss_sum / cfg.grad_accum)
        dt = time.perf_counter() - t0
        run.progress.write("step", step=state.step, loss=loss_value, lr=lr,
                           tokens_per_s=step_tokens / dt, step_time_s=dt)
        if state.step % cfg.checkpoint_every == 0 or state.step == run.target:
            commit_checkpoint(run, engine, state)
        if run.rank == 0:
            for fault in due_faults(run.spec.faults, state.step, run.args.attempt):
                inject(fault, run.events, state.step, run.last_commit and run.last_commit[0])
    return loss_value


# ---- the segment -----------------------------------------------------------------------
def run_segment(args: argparse.Namespace, rank: int, world: int) -> None:
    spec = load_spec(args.spec)
    if world != spec.train.world_size:
        raise BadConfig("train.procs_per_node", f"spec wants world size {spec.train.world_size} "
                        f"(nodes x procs_per_node), launched with {world}",
                        "launch nproc_per_node x nnodes processes matching the spec")
    if args.to_step < 1:
        raise BadConfig("--to-step", f"must be >= 1, got {args.to_step}", "pass a positive step")
    run = Run(args, spec, rank, world)
    if run.store.latest_committed(at_or_before=args.to_step) == args.to_step:
        if rank == 0:  # idempotent retry: the segment already finished
            man = run.store.manifest(args.to_step)
            write_result(run, final_step=args.to_step, train_loss=None,
                         tokens_seen=man.tokens_seen, steps_run=0, resumed_from=args.to_step,
                         last=(args.to_step, run.store.uri(args.to_step)))
        log.info("segment_already_done", to_step=args.to_step)
        return

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0)
                          or max(1, (os.cpu_count() or 1) // world))
    import deepspeed

    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")

    manifest = load_manifest(args.dataset)
    tokens, _ = read_split(args.dataset, "train")
    model = GPT(spec.model, manifest.vocab_size, seed=spec.seed)
    engine = build_engine(spec, model)
    batches = TrainBatches(tokens, seq_len=spec.model.seq_len, batch_size=micro_batch_size(spec),
                           seed=spec.seed, rank=rank, world=world, source=args.dataset)

    state = restore(run, engine)
    resumed_from = state.step if state else None
    if state is None:  # fresh run: seed every RNG, then commit step 0 as the rollback base
        random.seed(spec.seed + rank)
        np.random.seed(spec.seed + rank)
        torch.manual_seed(spec.seed + rank)
        state = TrainState()
    run.progress.write("start", resumed_from=resumed_from, world_size=world,
                       params=model.param_count(), to_step=args.to_step, attempt=args.attempt)
    log.info("segment_started", resumed_from=resumed_from, to_step=args.to_step,
             world_size=world, params=model.param_count())
    if resumed_from is None:
        commit_checkpoint(run, engine, state)

    first = state.step
    loss = train(run, engine, batches, state)
    if rank == 0:
        write_result(run, final_step=state.step, train_loss=loss, tokens_seen=state.tokens_seen,
                     steps_run=state.step - first, resumed_from=resumed_from, last=run.last_commit)
    log.info("segment_finished", final_step=state.step, train_loss=loss)


def write_result(run: Run, *, final_step: int, train_loss: float | None, tokens_seen: int,
                 steps_run: int, resumed_from: int | None, last: tuple[int, str] | None) -> None:
    write_json(os.path.join(run.workdir, "result.json"), {
        "final_step": final_step,
        "last_committed_step": last[0] if last else None,
        "last_committed_uri": last[1] if last else None,
        "train_loss": train_loss if train_loss is None or math.isfinite(train_loss) else None,
        "tokens_seen": tokens_seen, "steps_run": steps_run, "resumed_from": resumed_from,
    })


def single_process_env() -> None:
    """Let `python -m trainer.segment` run without torchrun (world size 1)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.segment", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="RunSpec JSON file")
    p.add_argument("--dataset", required=True, help="dataset MANIFEST.json URI")
    p.add_argument("--to-step", type=int, required=True, help="train until this global step")
    p.add_argument("--workdir", required=True, help="local directory for progress and results")
    p.add_argument("--attempt", type=int, default=1, help="activity attempt (for events)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    single_process_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(args.workdir, exist_ok=True)
    structlog.contextvars.bind_contextvars(rank=rank, attempt=args.attempt)
    if rank == 0:
        for name in ("result.json", "error.json"):  # stale files from an earlier attempt
            if os.path.exists(os.path.join(args.workdir, name)):
                os.unlink(os.path.join(args.workdir, name))
    code = 0
    try:
        run_segment(args, rank, world)
    except (BadConfig, BadData, StorageUnavailable) as exc:
        log.error("segment_failed", kind=exc.kind, message=str(exc))
        write_json(os.path.join(args.workdir, "error.json"), {"type": exc.kind, "message": str(exc)})
        code = EXIT_STORAGE if isinstance(exc, StorageUnavailable) else EXIT_BAD_INPUT
    except MainspringError as exc:
        log.exception("segment_failed", kind=exc.kind)
        code = 1
    except Exception:  # the supervisor classifies any other death as a HardwareFault
        log.exception("segment_crashed")
        code = 1
    if code == 0 and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
