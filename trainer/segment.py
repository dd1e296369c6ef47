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
from storage.tiered import TierPolicy, TieredCheckpointer
from trainer.data import PackedBatches, TrainBatches, skip_past
from trainer.faults import due_faults, inject
from trainer.engine import build_engine, lr_at, micro_batch_size, set_lr, tokens_per_step
from trainer.model import GPT
from trainer.state import TrainState, state_file
from trainer.throughput import DTYPES, Meter, flops_per_token, matmul_params, peak_flops, \
    peak_memory_bytes

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
def _fast_store(run: Run) -> CheckpointStore:
    """The fast tier: a local store under the segment's workdir (shared by a node's ranks).

    Per workdir, so a retry of this segment on this machine resumes locally; a segment only
    succeeds once every checkpoint is durable, so the next segment needs nothing from here.
    """
    if "fast_store" not in run.__dict__:
        run.fast_store = CheckpointStore.local(os.path.join(run.workdir, "ckpt"))
    return run.fast_store


def _checkpointer(run: Run) -> TieredCheckpointer:
    """Rank 0's uploader: fast tier → durable store, made on first use."""
    if "checkpointer" not in run.__dict__:
        run.checkpointer = TieredCheckpointer(
            run.store, _fast_store(run), TierPolicy.from_storage(run.spec.storage),
            events=run.events, on_commit=lambda man, uri: _on_durable_commit(run, man, uri))
    return run.checkpointer


def _on_durable_commit(run: Run, man: CheckpointManifest, uri: str) -> None:
    """Uploader thread, after the durable manifest is written: only now is it committed."""
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


def restore(run: Run, engine) -> TrainState | None:
    """Load the newest verified checkpoint at or before the target step; None if there is none.

    Rank 0 picks it from either tier (TieredCheckpointer.resume: fast copies verified in
    place, durable ones verified while fetched, corrupt ones reported and skipped) and
    broadcasts (step, tier). Layouts `ckpt/step-X/` (fast tier) and
    `restore-rank{r}/step-X/` are DeepSpeed's `load_dir/tag/`.
    """
    root = os.path.join(run.workdir, f"restore-rank{run.rank}")
    shutil.rmtree(root, ignore_errors=True)
    pick, man = None, None
    if run.rank == 0:
        def on_corrupt(exc) -> None:
            run.events.emit("checkpoint_corrupt", step=exc.step, file=exc.file,
                            event_id=f"checkpoint_corrupt/{exc.step}/{exc.file}",
                            expected=exc.expected, actual=exc.actual)
            run.events.flush()

        found = _checkpointer(run).resume(root, at_or_before=run.target, on_corrupt=on_corrupt)
        if found:
            man, _, tier = found
            pick = (man.step, tier)
    if run.world > 1:
        box = [pick]
        dist.broadcast_object_list(box, src=0)
        pick = box[0]
    if pick is None:
        return None
    step, tier = pick
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
    shutil.rmtree(os.path.join(run.workdir, f"restore-rank{run.rank}"), ignore_errors=True)
    if run.rank == 0:
        run.checkpointer.last_step = step
        durable = run.store.latest_committed(at_or_before=step)  # heartbeats: durable only
        run.last_commit = None
        if durable is not None:  # a kill between manifest and event flush loses only the
            # newest commit's event; announcing it again is idempotent (same event_id)
            _on_durable_commit(run, run.store.manifest(durable), run.store.uri(durable))
    return state


def commit_checkpoint(run: Run, engine, state: TrainState) -> None:
    """Save on every rank to the fast tier (the loop's only pause); rank 0 then hands the
    snapshot to the uploader, which commits it durably (manifest last) and only then
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


# ---- the step loop ---------------------------------------------------------------------
def train(run: Run, engine, batches: TrainBatches | PackedBatches, state: TrainState,
          meter: Meter) -> float | None:
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
            x, y, *packed = (t.to(engine.device) for t in batches.get(state.data_cursor))
            # Packed rows also carry (position_ids, doc_ids): attention stays per document.
            _, loss = engine(x, y, **dict(zip(("position_ids", "doc_ids"), packed)))
            engine.backward(loss)
            engine.step()
            state.data_cursor += 1
            loss_sum += loss.detach().float().cpu()
        state.step += 1
        state.tokens_seen += step_tokens
        loss_value = run.mean_over_ranks(loss_sum / cfg.grad_accum)
        dt = time.perf_counter() - t0
        run.progress.write("step", step=state.step, loss=loss_value, lr=lr,
                           **meter.add(step_tokens, dt),
                           peak_mem_bytes=peak_memory_bytes(torch.device(engine.device)))
        if state.step % cfg.checkpoint_every == 0 or state.step == run.target:
            commit_checkpoint(run, engine, state)
        if run.rank == 0:
            for fault in due_faults(run.spec.faults, state.step, run.args.attempt):
                inject(fault, run.events, state.step, run.last_commit and run.last_commit[0])
    return loss_value


# ---- the segment -----------------------------------------------------------------------
def make_batches(spec: RunSpec, dataset: str, rank: int, world: int
                 ) -> TrainBatches | PackedBatches:
    """Packed documents (train.packing) or fixed windows of the token stream."""
    tokens, doc_starts = read_split(dataset, "train")
    common = {"seq_len": spec.model.seq_len, "batch_size": micro_batch_size(spec),
              "seed": spec.seed, "rank": rank, "world": world, "source": dataset}
    if spec.train.packing:
        return PackedBatches(tokens, doc_starts, **common)
    return TrainBatches(tokens, **common)


def make_meter(spec: RunSpec, model: GPT, vocab_size: int, device: torch.device,
               world: int) -> Meter:
    """FLOPs per token of this model and the peak its MFU is measured against."""
    n = matmul_params(model.param_count(), spec.model, vocab_size)
    fpt = flops_per_token(n, spec.model.n_layers, spec.model.d_model, spec.model.seq_len)
    peak, source = peak_flops(spec.train.peak_tflops, device, DTYPES[spec.train.precision])
    return Meter(flops_token=fpt, peak=peak, peak_source=source, devices=world)


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
    model = GPT(spec.model, manifest.vocab_size, seed=spec.seed)
    engine = build_engine(spec, model)
    batches = make_batches(spec, args.dataset, rank, world)
    meter = make_meter(spec, model, manifest.vocab_size, torch.device(engine.device), world)

    state = restore(run, engine)
    resumed_from = state.step if state else None
    if state is None:  # fresh run: seed every RNG, then commit step 0 as the rollback base
        random.seed(spec.seed + rank)
        np.random.seed(spec.seed + rank)
        torch.manual_seed(spec.seed + rank)
        state = TrainState()
    run.progress.write("start", resumed_from=resumed_from, world_size=world,
                       params=model.param_count(), to_step=args.to_step, attempt=args.attempt,
                       packing=spec.train.packing, flops_per_token=meter.flops_token,
                       peak_tflops=meter.peak / 1e12, peak_source=meter.peak_source)
    log.info("segment_started", resumed_from=resumed_from, to_step=args.to_step,
             world_size=world, params=model.param_count())
    if resumed_from is None:
        commit_checkpoint(run, engine, state)

    first = state.step
    loss = train(run, engine, batches, state, meter)
    finish_uploads(run)  # every checkpoint durable before the segment reports success
    if rank == 0:
        write_result(run, final_step=state.step, train_loss=loss, tokens_seen=state.tokens_seen,
                     steps_run=state.step - first, resumed_from=resumed_from, last=run.last_commit,
                     throughput=meter.summary(torch.device(engine.device)))
    log.info("segment_finished", final_step=state.step, train_loss=loss)


def write_result(run: Run, *, final_step: int, train_loss: float | None, tokens_seen: int,
                 steps_run: int, resumed_from: int | None, last: tuple[int, str] | None,
                 throughput: dict[str, Any] | None = None) -> None:
    write_json(os.path.join(run.workdir, "result.json"), {
        "final_step": final_step,
        "last_committed_step": last[0] if last else None,
        "last_committed_uri": last[1] if last else None,
        "train_loss": train_loss if train_loss is None or math.isfinite(train_loss) else None,
        "tokens_seen": tokens_seen, "steps_run": steps_run, "resumed_from": resumed_from,
        **(throughput or {}),
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
