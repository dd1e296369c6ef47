"""`python -m trainer.segment`: train one segment, from the newest committed checkpoint to step B.

Launched by the train_segment supervisor (one process per rank):

    python -m torch.distributed.run --standalone --nproc_per_node W -m trainer.segment \
        --spec SPEC.json --dataset MANIFEST_URI --to-step B --workdir DIR --attempt N

Files in DIR (typed in common/protocol.py): `progress.jsonl` (rank 0; a `start` line, a
`step` line per optimizer step, a `commit` line per committed checkpoint, an `eval` line per
online evaluation), `result.json` on success, `error.json` on a classified failure.
Exit codes: 0 done; 3 BadConfig/BadData/Diverged (non-retryable, error.json); 4
StorageUnavailable (retryable, error.json); anything else is a crash (retryable).
"""

from __future__ import annotations

import os
import signal
import sys

from common.parentage import parent_of
from common.procs import WORKER_PID_ENV, set_parent_death_signal


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when our parent (torchrun, or the worker's standby) dies.

    Runs before torch is imported so there is no window in which an orphaned rank could
    hold a GPU (DESIGN §5). If the parent is already gone we were re-parented: our parent
    is then no longer a child of the worker whose pid the supervisor put in our
    environment (torchrun and the standby both are). Not "our parent is 1": the worker may
    be PID 1 of its container, and a subreaper may adopt us instead. Run by hand (no
    worker pid), a parent of 1 is taken for init.
    """
    set_parent_death_signal()
    worker, launcher = int(os.environ.get(WORKER_PID_ENV) or 0), os.getppid()
    if (parent_of(launcher) != worker) if worker else launcher == 1:
        sys.exit(1)


if __name__ == "__main__":
    die_with_parent()


import argparse
import json
import random
import socket
import time

import numpy as np
import structlog
import torch
import torch.distributed as dist

from common.errors import BadConfig, BadData
from common.protocol import OperatorRollback, SegmentOutcome, SegmentResult, StartLine, StepLine
from spec import RunSpec
from storage.checkpoints import CheckpointManifest, CheckpointStore, CorruptCheckpoint
from storage.dataset import load_manifest, read_split
from trainer import operator_rollback, tracing
from trainer.checkpointing import commit_checkpoint, finish_uploads, restore, rollback_to
from trainer.child import load_spec, run_classified, write_json
from trainer.context import SegmentArgs, SegmentContext, on_sigterm
from trainer.data import PackedBatches, TrainBatches, skip_past, val_batches
from trainer.elastic import on_nodes
from trainer.engine import build_engine, micro_batch_size, set_lr, tokens_per_step, veto_next_update
from trainer.extensions import install_owned_build_locks
from trainer.faults import FaultInjector, FaultyBatches
from trainer.guard import SpikeGuard, finite_or_none, recorded_skip_ranges
from trainer.model import GPT, IGNORE
from trainer.online_eval import OnlineEval
from trainer.schedule import LRSchedule
from trainer.spikes import merge_ranges
from trainer.state import TrainState
from trainer.step_metrics import StepProbe
from trainer.throughput import (
    DTYPES,
    Meter,
    flops_per_token,
    matmul_params,
    peak_flops,
    peak_memory_bytes,
)

log = structlog.get_logger(__name__)
install_owned_build_locks()  # before DeepSpeed loads an op: a dead loader's lock is cleared


# ---- the step loop ---------------------------------------------------------------------
def train(ctx: SegmentContext, engine, batches: FaultyBatches, state: TrainState,
          lr: LRSchedule, meter: Meter, spikes: SpikeGuard, evals: OnlineEval,
          faults: FaultInjector) -> TrainState:
    """Optimizer steps from state.step to ctx.target. Each step: fetch and forward/backward
    its micro-batches → the verdict on its loss (trainer/guard.py) → skip | step, then a
    rollback if asked → maybe commit a checkpoint → progress, online evaluation. Returns
    the final state (a rollback replaces it with the restored one)."""
    cfg, outcome, every = ctx.spec.train, spikes.outcome, ctx.checkpoint_every
    step_tokens = tokens_per_step(ctx.spec)
    probe = StepProbe(ctx, engine)  # grad norm, memory, sampled overlap (issue 17)
    while state.step < ctx.target and not outcome.stopped:
        t0 = time.perf_counter()
        step = state.step + 1  # the step being run, 1-based
        probe.begin(step)
        set_lr(engine, step_lr := lr(step))
        first_cursor = skip_past(state.data_cursor, state.skip_ranges)
        loss_sum = forward_backward(engine, batches, state, step, cfg.grad_accum,
                                    ctx.args.micro_split)
        # sync point (one per step): the mean of the chunks' mean losses
        loss, stop = ctx.loss_and_stop(loss_sum / (cfg.grad_accum * ctx.args.micro_split))
        verdict = spikes.judge(state, step, loss, first_cursor)
        if verdict.action != "ok":  # skip | rollback: this batch's update is vetoed
            veto_next_update(engine)
        probe.before_update(engine)
        engine.step()  # the update (a no-op when vetoed; DeepSpeed's bookkeeping still runs)
        state.step, state.tokens_seen = step, state.tokens_seen + step_tokens
        ctx.progress.write(StepLine(step=step, loss=finite_or_none(loss), lr=step_lr,
                                    verdict=verdict.action,
                                    **meter.add(step_tokens, time.perf_counter() - t0),
                                    peak_mem_bytes=peak_memory_bytes(torch.device(engine.device)),
                                    **probe.fields(step, engine)))
        verdict = spikes.after_step(step, loss, verdict)  # fp16: overflow at the minimum scale
        if verdict.action == "rollback":
            state = spikes.rollback(state, verdict)
            continue
        if state.step % every == 0 or state.step == ctx.target:
            commit_checkpoint(ctx, engine, state)
        if ctx.rank == 0:
            faults.after_step(state.step, ctx.last_commit and ctx.last_commit[0])
        evals.maybe_evaluate(state)
        if stop:  # the supervisor's stop file, or a SIGTERM: stop after this step
            outcome.stopped = "interrupted"
            log.warning("segment_interrupted", step=state.step, reason=stop)
    if outcome.stopped in ("overfitting", "interrupted") \
            and state.step % every and state.step != ctx.target:
        commit_checkpoint(ctx, engine, state)  # an early stop ends on a committed step
    return state


def forward_backward(engine, batches: FaultyBatches, state: TrainState, step: int,
                     micro_batches: int, split: int = 1) -> torch.Tensor:
    """Forward and backward every micro-batch of `step`, each as `split` equal chunks (an
    OOM-adapted run: the same sequences, the same global batch), advancing the data cursor
    past skipped ranges; the summed loss stays on the device (no host sync here). DeepSpeed
    wants engine.step() after each forward/backward; it updates only on the last one, which
    the loop does itself once it has judged the loss."""
    loss_sum = torch.zeros((), dtype=torch.float32, device=engine.device)
    passes = 0
    for _ in range(micro_batches):
        state.data_cursor = skip_past(state.data_cursor, state.skip_ranges)
        tensors = [t.to(engine.device) for t in batches.get(state.data_cursor, step)]
        chunks = list(zip(*(t.chunk(split) for t in tensors)))
        weights = chunk_weights([c[1] for c in chunks])
        for (x, y, *packed), weight in zip(chunks, weights):
            if passes:
                engine.step()  # a gradient-accumulation boundary is not reached: no update
            # Packed rows also carry (position_ids, doc_ids): attention stays per document.
            _, loss = engine(x, y, **dict(zip(("position_ids", "doc_ids"), packed)))
            if weight is not None:
                loss = torch.where(weight > 0, loss * weight, torch.zeros_like(loss))
            engine.backward(loss)
            loss_sum += loss.detach().float()
            passes += 1
        state.data_cursor += 1
    return loss_sum


def chunk_weights(targets: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per chunk of a split micro-batch, the factor that makes the chunks' mean losses add
    up to the whole micro-batch's mean over its scored targets (a chunk's share of them,
    times the number of chunks: DeepSpeed divides by the accumulation). None for an unsplit
    micro-batch: its loss is used as it is. On the device, no host sync."""
    if len(targets) == 1:
        return [None]
    counts = [(y != IGNORE).sum().float() for y in targets]
    total = torch.clamp(sum(counts), min=1.0)
    return [c / total * len(targets) for c in counts]


# ---- the segment -----------------------------------------------------------------------
def make_batches(spec: RunSpec, dataset: str, rank: int, world: int,
                 cache_dir: str | None = None) -> TrainBatches | PackedBatches:
    """Packed documents (train.packing) or fixed windows of the token stream."""
    tokens, doc_starts = read_split(dataset, "train", cache_dir)
    common = {"seq_len": spec.model.seq_len, "batch_size": micro_batch_size(spec),
              "seed": spec.seed, "rank": rank, "world": world, "source": dataset}
    if spec.train.packing:
        return PackedBatches(tokens, doc_starts, **common)
    return TrainBatches(tokens, **common)


def make_val(spec: RunSpec, dataset: str, cache_dir: str | None = None
             ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Validation batches for online evaluation (train.eval_every > 0), else None."""
    if not spec.train.eval_every:
        return None
    tokens, _ = read_split(dataset, "val", cache_dir)
    return val_batches(tokens, seq_len=spec.model.seq_len, batch_size=micro_batch_size(spec),
                       k=spec.train.eval_batches, source=dataset)


def make_meter(spec: RunSpec, model: GPT, vocab_size: int, device: torch.device,
               world: int, cache_dir: str | None = None) -> Meter:
    """FLOPs per token of this model and the peak its MFU is measured against."""
    n = matmul_params(model.param_count(), spec.model, vocab_size)
    fpt = flops_per_token(n, spec.model.n_layers, spec.model.d_model, spec.model.seq_len)
    peak, source = peak_flops(spec.train.peak_tflops, device, DTYPES[spec.train.precision],
                              cache_dir)
    return Meter(flops_token=fpt, peak=peak, peak_source=source, devices=world)


# what the start-up reads of the run's event log (the skip windows of rollbacks decided
# after the restored checkpoint, an operator rollback applied already): read in advance
STARTUP_EVENTS = ("rollback", "rollback_refused")


def run_segment(args: SegmentArgs, rank: int, world: int) -> None:
    run_spec = load_spec(args.spec)
    spec = on_nodes(run_spec, args.nnodes)  # fewer nodes: the same global batch (elastic)
    if world != spec.train.world_size:
        raise BadConfig("train.procs_per_node", f"spec wants world size {spec.train.world_size} "
                        f"(nodes x procs_per_node), launched with {world}",
                        "launch nproc_per_node x nnodes processes matching the spec")
    if args.to_step < 1:
        raise BadConfig("--to-step", f"must be >= 1, got {args.to_step}", "pass a positive step")
    if args.checkpoint_every < 0:
        raise BadConfig("--checkpoint-every", f"must be >= 0, got {args.checkpoint_every}",
                        "pass a positive number of steps, or 0 for the spec's")
    ctx = SegmentContext(args, spec, rank, world, config_hash=run_spec.spec_hash())
    # (an operator rollback must first uncommit the abandoned trajectory's checkpoints; a
    # restart in place follows a launch that failed before its end: no listing for it)
    done = None if args.rollback or args.restart or args.unfinished \
        else finished_manifest(ctx.store, args.to_step)
    if done is not None:
        if rank == 0:  # idempotent retry: the segment already finished
            write_result(ctx, SegmentResult(
                final_step=args.to_step, last_committed_step=args.to_step,
                last_committed_uri=ctx.store.uri(args.to_step), train_loss=None,
                tokens_seen=done.tokens_seen, steps_run=0, resumed_from=args.to_step))
        log.info("segment_already_done", to_step=args.to_step)
        return

    ctx.prefetch_events(STARTUP_EVENTS)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 0)
                          or max(1, (os.cpu_count() or 1) // world))
    import deepspeed

    deepspeed.utils.logger.setLevel("WARNING")
    with tracing.span("process_group_init", badput="startup", rank=rank):
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        manifest = load_manifest(args.dataset)
        model = GPT(spec.model, manifest.vocab_size, seed=spec.seed)
        engine = build_engine(spec, model, args.micro_split)
    source = make_batches(spec, args.dataset, rank, world, args.cache("dataset"))
    meter = make_meter(spec, model, manifest.vocab_size, torch.device(engine.device), world,
                       args.cache("device"))

    rollback = operator_rollback.pending(ctx, args.rollback)  # applied once per command id
    restore_began = time.perf_counter()
    with tracing.span("rollback" if rollback else "restore",
                      badput="rollback" if rollback else "restore", rank=rank):
        if rollback:
            state, discarded = rollback_to(ctx, engine, rollback.to_step)
        else:
            state, discarded = restore(ctx, engine), []
    restore_s = time.perf_counter() - restore_began
    if rollback and state is None:  # retention removed the target after it was admitted
        operator_rollback.refuse(ctx, rollback, ctx.from_rank0(ctx.store.latest_committed))
        return end_at_newest(ctx)
    if state is None:
        refuse_fresh_start(ctx)
    resumed_from = state.step if state else None
    if state is not None:  # windows decided by rollbacks after this checkpoint was written
        state.skip_ranges = merge_ranges(state.skip_ranges + recorded_skip_ranges(ctx))
        if rollback:
            operator_rollback.apply(ctx, state, rollback, discarded)
    if state is None:  # fresh run: seed every RNG, then commit step 0 as the rollback base
        random.seed(spec.seed + rank)
        np.random.seed(spec.seed + rank)
        torch.manual_seed(spec.seed + rank)
        state = TrainState()
    ctx.progress.write(StartLine(
        resumed_from=resumed_from, world_size=world, params=model.param_count(),
        to_step=args.to_step, attempt=args.attempt, restart=args.restart,
        packing=spec.train.packing,
        flops_per_token=meter.flops_token, peak_tflops=meter.peak / 1e12,
        peak_source=meter.peak_source, restore_s=round(restore_s, 3) if state else 0.0,
        restore_tier=ctx.restored[1] if ctx.restored and resumed_from is not None else "",
        checkpoint_every=ctx.checkpoint_every))
    log.info("segment_started", resumed_from=resumed_from, to_step=args.to_step,
             world_size=world, params=model.param_count())
    if resumed_from is None:
        commit_checkpoint(ctx, engine, state)

    first = state.step
    # Fault injection is wired here, once: the batch source, the LR windows, a model hook.
    faults = FaultInjector(spec.faults, batches_per_step=spec.train.grad_accum,
                           vocab_size=manifest.vocab_size, seed=spec.seed,
                           attempt=args.attempt, events=ctx.events)
    faults.attach(engine.module)
    batches = faults.batches(source)
    lr = LRSchedule(spec.train, args.lr_windows, one_shot=faults.lr_windows())
    outcome = SegmentOutcome()
    spikes = SpikeGuard(ctx, engine, outcome, args.max_rollbacks)
    evals = OnlineEval(ctx, engine, make_val(spec, args.dataset, args.cache("dataset")), spikes,
                       outcome)
    state = train(ctx, engine, batches, state, lr, meter, spikes, evals, faults)
    ctx.windows.close()
    ctx.settle()  # the restored step's announcement (its last_commit) before the result
    finish_uploads(ctx)  # every checkpoint durable before the segment reports success
    if ctx.events is not None:
        ctx.events.flush()  # decisions after the last checkpoint (evaluations) too
    loss = spikes.recent_loss()
    if rank == 0:
        last = ctx.last_commit
        write_result(ctx, SegmentResult(
            final_step=state.step, last_committed_step=last[0] if last else None,
            last_committed_uri=last[1] if last else None, train_loss=finite_or_none(loss),
            tokens_seen=state.tokens_seen, steps_run=state.step - first,
            resumed_from=resumed_from, outcome=outcome,
            throughput=meter.summary(torch.device(engine.device)),
            checkpoint_stall_s=round(ctx.stall_s, 4), checkpoints=ctx.stalls))
    log.info("segment_finished", final_step=state.step, train_loss=loss,
             stopped=outcome.stopped, rollbacks=len(outcome.rollbacks))


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
    work (issue 11: an operator rollback to a step retention had removed did exactly that)."""
    newer = ctx.from_rank0(lambda: [s for s in ctx.store.list_committed() if s > ctx.target])
    if newer:
        raise BadData(ctx.store.uri(newer[0]), f"no loadable checkpoint at or before step "
                      f"{ctx.target}, but steps {newer[:5]} are committed after it",
                      "see the checkpoint_corrupt events; schedule the segment from a "
                      "committed step (the run's status shows it)")


def end_at_newest(ctx: SegmentContext) -> None:
    """Report the run's real position (its newest commit) without training: the workflow
    moved its step back to a rollback target that turned out to be gone."""
    if ctx.rank != 0:
        return
    newest = ctx.store.latest_committed()
    man = ctx.store.manifest(newest)
    write_result(ctx, SegmentResult(
        final_step=newest, last_committed_step=newest, last_committed_uri=ctx.store.uri(newest),
        train_loss=None, tokens_seen=man.tokens_seen, steps_run=0, resumed_from=newest,
        outcome=SegmentOutcome(stopped="rollback_refused")))


def write_result(ctx: SegmentContext, result: SegmentResult) -> None:
    write_json(os.path.join(ctx.workdir, "result.json"), result)


def single_process_env() -> None:
    """Let `python -m trainer.segment` run without torchrun (world size 1)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def parse_args(argv: list[str] | None = None) -> SegmentArgs:
    p = argparse.ArgumentParser(prog="python -m trainer.segment", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", required=True, help="RunSpec JSON file")
    p.add_argument("--dataset", required=True, help="dataset MANIFEST.json URI")
    p.add_argument("--to-step", type=int, required=True, help="train until this global step")
    p.add_argument("--workdir", required=True, help="local directory for progress and results")
    p.add_argument("--fast-dir", default=None,
                   help="the run's fast-tier checkpoint store on this machine (default: "
                        "WORKDIR/ckpt); shared by the run's segments")
    p.add_argument("--cache-dir", default=None,
                   help="keep verified copies of the dataset's shards and the event log's "
                        "batches in this local directory and read them from there (default: "
                        "fetch them every launch)")
    p.add_argument("--attempt", type=int, default=1, help="activity attempt (for events)")
    p.add_argument("--restart", type=int, default=0,
                   help="the attempt's restarts in place so far (for events)")
    p.add_argument("--unfinished", action="store_true",
                   help="the supervisor's listing just before this launch had no commit of "
                        "--to-step: skip the check for an already finished segment")
    # The supervisor passes the windows in a file: argv is bounded (E2BIG at ~7,000
    # windows, issue 11); inline JSON stays for running a segment by hand.
    lr = p.add_mutually_exclusive_group()
    lr.add_argument("--lr-windows", type=json.loads, default=[],
                    help='JSON [[start, end, factor], ...]: LR x factor for steps in (start, end]')
    lr.add_argument("--lr-windows-file", default=None,
                    help="a JSON file holding the --lr-windows list (what the supervisor passes)")
    p.add_argument("--rollback", type=OperatorRollback.from_json, default=None,
                   help='JSON {"id", "to_step", "through_step", "skip_data", "note", "who"}: '
                        "an operator rollback to apply before training (once per id)")
    p.add_argument("--max-rollbacks", type=int, default=-1,
                   help="end the segment early after this many rollbacks (-1: no limit)")
    p.add_argument("--micro-split", type=int, default=1,
                   help="run each micro-batch as this many equal chunks (after an OOM; the "
                        "same global batch and data order)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes this segment spans (fewer than train.nodes: elastic, the same "
                        "global batch)")
    p.add_argument("--session", default="",
                   help="the multi-node launch's id (its checkpoint parts carry it)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="steps between checkpoints, as the workflow chose them for "
                        'train.checkpoint_every "auto" (0: the spec\'s)')
    ns = p.parse_args(argv)
    windows = ns.lr_windows
    if ns.lr_windows_file:
        with open(ns.lr_windows_file) as f:
            windows = json.load(f)
    return SegmentArgs(spec=ns.spec, dataset=ns.dataset, to_step=ns.to_step, workdir=ns.workdir,
                       fast_dir=ns.fast_dir, cache_dir=ns.cache_dir,
                       attempt=ns.attempt, restart=ns.restart, unfinished=ns.unfinished,
                       lr_windows=tuple(tuple(w) for w in windows), rollback=ns.rollback,
                       max_rollbacks=ns.max_rollbacks, micro_split=ns.micro_split,
                       nnodes=ns.nnodes, session=ns.session,
                       checkpoint_every=ns.checkpoint_every)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    single_process_env()
    signal.signal(signal.SIGTERM, on_sigterm)  # a preemption notice: stop at a checkpoint
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(args.workdir, exist_ok=True)
    with open(os.path.join(args.workdir, f"rank{rank}.pid"), "w") as f:  # who died, if one does
        f.write(str(os.getpid()))
    structlog.contextvars.bind_contextvars(rank=rank, attempt=args.attempt)
    process = trace_process(args, rank)
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:  # each node's leader: its workdir
        for name in ("result.json", "error.json"):  # stale files from an earlier attempt
            if os.path.exists(os.path.join(args.workdir, name)):
                os.unlink(os.path.join(args.workdir, name))
    # One classification path for every child (trainer/child.py): a Diverged segment
    # writes error.json and exits 3, so the supervisor does not retry it.
    code = run_classified("segment", args.workdir, lambda: run_segment(args, rank, world))
    if code == 0 and dist.is_initialized():
        # All ranks leave together: a rank tearing down its process group while another
        # still drains uploads died with SIGABRT ("terminate called without an active
        # exception") in about one world-size-2 run in three.
        dist.barrier()
        dist.destroy_process_group()
    if process is not None:
        tracing.end_process_span(process, code)
    return code


def trace_process(args: SegmentArgs, rank: int):
    """This rank's tracing and process span (trainer/tracing.py); None when its spec cannot
    be read — the segment then fails on it, classified, as it would anyway."""
    try:
        spec = load_spec(args.spec)
    except BadConfig:
        return None
    structlog.contextvars.bind_contextvars(run_id=spec.run_id)
    return tracing.start_process_span(spec, rank, args.attempt)


def leave(code: int) -> None:
    """Exit with `code`, skipping the interpreter's teardown after a clean finish.

    At world size 2 on CPU a rank that had finished, passed the final barrier and destroyed
    its process group still died in one run in three to four under load with SIGABRT
    ("terminate called without an active exception": a C++ thread of the comm stack
    destroyed unjoined at interpreter exit), after its results were written. Everything a
    segment must leave behind is durable by then (uploads drained, events flushed,
    result.json written), so the exit skips the C++ static destructors."""
    if code == 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    leave(main())
