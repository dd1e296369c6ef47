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
import signal
import sys

from common.procs import set_parent_death_signal


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


import argparse
import dataclasses
import json
import random
import socket
import time
from typing import Any

import numpy as np
import structlog
import torch
import torch.distributed as dist

from common.errors import BadConfig, BadData
from spec import RunSpec
from storage.checkpoints import CheckpointManifest, CheckpointStore, CorruptCheckpoint
from storage.dataset import load_manifest, read_split
from trainer.checkpointing import (
    Run,
    commit_checkpoint,
    finish_uploads,
    load_spec,
    on_sigterm,
    restore,
    rollback_to,
    run_classified,
    write_json,
)
from trainer.data import PackedBatches, TrainBatches, skip_past, val_batches
from trainer.engine import build_engine, lr_at, micro_batch_size, set_lr, tokens_per_step
from trainer.faults import Injector, due_faults, inject
from trainer.guard import (
    SpikeGuard,
    apply_rewind,
    finite_or_none,
    pending_rewind,
    recorded_skip_ranges,
    refuse_rewind,
)
from trainer.model import GPT
from trainer.spikes import merge_ranges
from trainer.state import TrainState
from trainer.throughput import (
    DTYPES,
    Meter,
    flops_per_token,
    matmul_params,
    peak_flops,
    peak_memory_bytes,
)

log = structlog.get_logger(__name__)



# ---- the step loop ---------------------------------------------------------------------
def train(run: Run, engine, batches: TrainBatches | PackedBatches, state: TrainState,
          meter: Meter, guard: SpikeGuard, inject_faults: Injector) -> TrainState:
    """Optimizer steps from state.step to run.target: judge every loss before its update
    (skip / roll back, trainer/guard.py), commit on schedule, evaluate online. Returns the
    final state (a rollback replaces it with the restored one)."""
    cfg = run.spec.train
    step_tokens = tokens_per_step(run.spec)
    while state.step < run.target and not guard.outcome.stopped:
        t0 = time.perf_counter()
        step = state.step + 1  # the step being run, 1-based
        lr = lr_at(state.step, cfg) * lr_scale(run.args.lr_windows, step) \
            * inject_faults.lr_factor(step)
        set_lr(engine, lr)
        first_cursor = skip_past(state.data_cursor, state.skip_ranges)
        loss_sum = torch.zeros((), dtype=torch.float32)
        for micro in range(cfg.grad_accum):  # engine.step() updates on the last micro-batch only
            state.data_cursor = skip_past(state.data_cursor, state.skip_ranges)
            x, y, *packed = (t.to(engine.device) for t in inject_faults.batch(
                state.data_cursor, step, batches.get(state.data_cursor)))
            # Packed rows also carry (position_ids, doc_ids): attention stays per document.
            _, loss = engine(x, y, **dict(zip(("position_ids", "doc_ids"), packed)))
            if micro == 0 and inject_faults.poison(step):
                loss = loss * float("nan")
            engine.backward(loss)
            loss_sum += loss.detach().float().cpu()
            if micro == cfg.grad_accum - 1:  # judged before the update: a bad one is vetoed
                loss_value, stop = run.loss_and_stop(loss_sum / cfg.grad_accum)
                verdict = guard.judge(state, step, loss_value, first_cursor)
            engine.step()
            state.data_cursor += 1
        state.step, state.tokens_seen = step, state.tokens_seen + step_tokens
        dt = time.perf_counter() - t0
        run.progress.write("step", step=step, loss=finite_or_none(loss_value), lr=lr,
                           verdict=verdict.action, **meter.add(step_tokens, dt),
                           peak_mem_bytes=peak_memory_bytes(torch.device(engine.device)))
        verdict = guard.after_step(step, loss_value, verdict)
        if verdict.action == "rollback":
            state = guard.rollback(state, verdict)
            continue
        if state.step % cfg.checkpoint_every == 0 or state.step == run.target:
            commit_checkpoint(run, engine, state)
        if run.rank == 0:
            for fault in due_faults(run.spec.faults, state.step, run.args.attempt):
                inject(fault, run.events, state.step, run.last_commit and run.last_commit[0])
        guard.maybe_evaluate(state)
        if stop:  # the supervisor's stop file, or a SIGTERM: stop after this step
            guard.outcome.stopped = "interrupted"
            log.warning("segment_interrupted", step=state.step, reason=stop)
    if guard.outcome.stopped in ("overfitting", "interrupted") \
            and state.step % cfg.checkpoint_every and state.step != run.target:
        commit_checkpoint(run, engine, state)  # an early stop ends on a committed step
    return state


def lr_scale(windows: list[list[float]], step: int) -> float:
    """Product of the workflow's LR factors [start, end, factor] whose window holds `step`."""
    scale = 1.0
    for start, end, factor in windows:
        if start < step <= end:
            scale *= factor
    return scale


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


def make_val(spec: RunSpec, dataset: str) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Validation batches for online evaluation (train.eval_every > 0), else None."""
    if not spec.train.eval_every:
        return None
    tokens, _ = read_split(dataset, "val")
    return val_batches(tokens, seq_len=spec.model.seq_len, batch_size=micro_batch_size(spec),
                       k=spec.train.eval_batches, source=dataset)


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
    # (an operator rollback must first uncommit the abandoned trajectory's checkpoints)
    done = None if args.rewind else finished_manifest(run.store, args.to_step)
    if done is not None:
        if rank == 0:  # idempotent retry: the segment already finished
            man = done
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

    rewind = pending_rewind(run, args.rewind)  # an operator's rollback, applied once
    if rewind:
        state, discarded = rollback_to(run, engine, int(rewind["to_step"]))
        if state is None:  # retention removed the target after the command was admitted
            refuse_rewind(run, rewind, run.from_rank0(run.store.latest_committed))
            return end_at_newest(run)
    else:
        state, discarded = restore(run, engine), []
    if state is None:
        refuse_fresh_start(run)
    resumed_from = state.step if state else None
    if state is not None:  # windows decided by rollbacks after this checkpoint was written
        state.skip_ranges = merge_ranges(state.skip_ranges + recorded_skip_ranges(run))
        if rewind:
            apply_rewind(run, state, rewind, discarded)
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
    guard = SpikeGuard(run, engine, make_val(spec, args.dataset), args.max_rollbacks)
    faults = Injector(spec.faults, batches_per_step=spec.train.grad_accum,
                      vocab_size=manifest.vocab_size, seed=spec.seed, events=run.events)
    state = train(run, engine, batches, state, meter, guard, faults)
    finish_uploads(run)  # every checkpoint durable before the segment reports success
    if run.events is not None:
        run.events.flush()  # decisions after the last checkpoint (evaluations) too
    loss = guard.recent_loss()
    if rank == 0:
        write_result(run, final_step=state.step, train_loss=loss, tokens_seen=state.tokens_seen,
                     steps_run=state.step - first, resumed_from=resumed_from, last=run.last_commit,
                     throughput=meter.summary(torch.device(engine.device)),
                     spikes=dataclasses.asdict(guard.outcome))
    log.info("segment_finished", final_step=state.step, train_loss=loss,
             stopped=guard.outcome.stopped, rollbacks=len(guard.outcome.rollbacks))


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


def refuse_fresh_start(run: Run) -> None:
    """No loadable checkpoint at or before the target: a fresh start is right only when the
    run has no newer one either — otherwise starting over at step 0 would bury committed
    work (issue 11: an operator rollback to a step retention had removed did exactly that)."""
    newer = run.from_rank0(lambda: [s for s in run.store.list_committed() if s > run.target])
    if newer:
        raise BadData(run.store.uri(newer[0]), f"no loadable checkpoint at or before step "
                      f"{run.target}, but steps {newer[:5]} are committed after it",
                      "see the checkpoint_corrupt events; schedule the segment from a "
                      "committed step (the run's status shows it)")


def end_at_newest(run: Run) -> None:
    """Report the run's real position (its newest commit) without training: the workflow
    moved its step back to a rollback target that turned out to be gone."""
    if run.rank != 0:
        return
    newest = run.store.latest_committed()
    man = run.store.manifest(newest)
    write_result(run, final_step=newest, train_loss=None, tokens_seen=man.tokens_seen,
                 steps_run=0, resumed_from=newest, last=(newest, run.store.uri(newest)),
                 spikes={"stopped": "rollback_refused"})


def write_result(run: Run, *, final_step: int, train_loss: float | None, tokens_seen: int,
                 steps_run: int, resumed_from: int | None, last: tuple[int, str] | None,
                 throughput: dict[str, Any] | None = None,
                 spikes: dict[str, Any] | None = None) -> None:
    write_json(os.path.join(run.workdir, "result.json"), {
        "final_step": final_step,
        "last_committed_step": last[0] if last else None,
        "last_committed_uri": last[1] if last else None,
        "train_loss": finite_or_none(train_loss),
        "tokens_seen": tokens_seen, "steps_run": steps_run, "resumed_from": resumed_from,
        **(throughput or {}),
        "spikes": spikes or {},
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
    p.add_argument("--fast-dir", default=None,
                   help="the run's fast-tier checkpoint store on this machine (default: "
                        "WORKDIR/ckpt); shared by the run's segments")
    p.add_argument("--attempt", type=int, default=1, help="activity attempt (for events)")
    # The supervisor passes the windows in a file: argv is bounded (E2BIG at ~7,000
    # windows, issue 11); inline JSON stays for running a segment by hand.
    lr = p.add_mutually_exclusive_group()
    lr.add_argument("--lr-windows", type=json.loads, default=[],
                    help='JSON [[start, end, factor], ...]: LR x factor for steps in (start, end]')
    lr.add_argument("--lr-windows-file", default=None,
                    help="a JSON file holding the --lr-windows list (what the supervisor passes)")
    p.add_argument("--rewind", type=json.loads, default=None,
                   help='JSON {"id", "to_step", "through_step", "skip_data"}: an operator '
                        "rollback to apply before training (once per id)")
    p.add_argument("--max-rollbacks", type=int, default=-1,
                   help="end the segment early after this many rollbacks (-1: no limit)")
    args = p.parse_args(argv)
    if args.lr_windows_file:
        with open(args.lr_windows_file) as f:
            args.lr_windows = json.load(f)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    single_process_env()
    signal.signal(signal.SIGTERM, on_sigterm)  # a preemption notice: stop at a checkpoint
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(args.workdir, exist_ok=True)
    structlog.contextvars.bind_contextvars(rank=rank, attempt=args.attempt)
    if rank == 0:
        for name in ("result.json", "error.json"):  # stale files from an earlier attempt
            if os.path.exists(os.path.join(args.workdir, name)):
                os.unlink(os.path.join(args.workdir, name))
    # Diverged (no checkpoint to roll back to) used to exit 1 with no error.json here, and
    # the supervisor retried it as a HardwareFault: one classification path for every child.
    code = run_classified("segment", args.workdir, lambda: run_segment(args, rank, world))
    if code == 0 and dist.is_initialized():
        # All ranks leave together: a rank tearing down its process group while another
        # still drains uploads died with SIGABRT ("terminate called without an active
        # exception") in about one world-size-2 run in three.
        dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
