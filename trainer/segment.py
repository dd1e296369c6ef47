"""`python -m trainer.segment`: train one segment, from the newest committed checkpoint to step B.

Launched by the train_segment supervisor (one process per rank):

    python -m torch.distributed.run --standalone --nproc_per_node W -m trainer.segment \
        --spec SPEC.json --dataset MANIFEST_URI --to-step B --workdir DIR --attempt N

Files in DIR (typed in common/protocol.py): `progress.jsonl` (rank 0; a `start` line, a
`step` line per optimizer step, a `commit` line per committed checkpoint, an `eval` line per
online evaluation), `result.json` on success, `error.json` on a classified failure.
Exit codes: 0 done; 3 BadConfig/BadData/Diverged (non-retryable, error.json); 4
StorageUnavailable (retryable, error.json); anything else is a crash (retryable).

This module sets a segment up and reports its result: where it starts is trainer/start.py,
the step loop trainer/loop.py, its checkpoints trainer/checkpoint_manager.py.
"""

from __future__ import annotations

import os
import signal
import sys

from common.parentage import parent_of
from common.procs import WORKER_PID_ENV, set_parent_death_signal, torch_threads


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
import socket

import structlog
import torch
import torch.distributed as dist

from common.errors import BadConfig
from common.protocol import OperatorRollback, SegmentOutcome, SegmentResult, StartLine
from spec import RunSpec
from spec.layout import pp_degree, tp_degree
from storage.dataset import load_manifest, read_split
from trainer import tracing
from trainer.checkpoint_manager import CheckpointManager
from trainer.child import load_spec, run_classified, write_json
from trainer.context import SegmentArgs, SegmentContext, on_sigterm
from trainer.data import PackedBatches, TrainBatches, val_batches
from trainer.diagnosis import Replayer, Sources
from trainer.elastic import on_nodes
from trainer.engine import build_engine, micro_batch_size
from trainer.extensions import install_owned_build_locks
from trainer.faults import FaultInjector
from trainer.guard import SpikeGuard, finite_or_none, resume_skipped_documents
from trainer.init_from import load_init_weights
from trainer.loop import Trainer
from trainer.model import GPT
from trainer.online_eval import OnlineEval
from trainer.oscillation_watch import recorded_lr_windows
from trainer.pipeline import last_stages, pp_ranks, teach
from trainer.pipeline_replay import PipeReplayer
from trainer.replicas import ReplicaCheck
from trainer.schedule import LRSchedule
from trainer.start import finished_manifest, start_state
from trainer.step_metrics import StepProbe
from trainer.stopping import ROLLBACK_REFUSED, Stopper, StopRules
from trainer.teacher import load_teacher
from trainer.tensor_parallel import tp_ranks
from trainer.throughput import DTYPES, Meter, flops_per_token, matmul_params, peak_flops

log = structlog.get_logger(__name__)
install_owned_build_locks()  # before DeepSpeed loads an op: a dead loader's lock is cleared


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
# after the restored checkpoint, an operator rollback applied already, the LR windows of
# oscillations): read in advance
STARTUP_EVENTS = ("rollback", "rollback_refused", "oscillation_detected")


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
    torch.set_num_threads(torch_threads(os.environ, os.cpu_count() or 1, world))
    import deepspeed

    deepspeed.utils.logger.setLevel("WARNING")
    with tracing.span("process_group_init", badput="startup", rank=rank):
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        manifest = load_manifest(args.dataset)
        model = GPT(spec.model, manifest.vocab_size, seed=spec.seed)
        if spec.train.init_from and ctx.store.latest_committed() is None:  # a fresh run
            load_init_weights(model, spec, args.workdir, rank)  # before ZeRO copies them
        tp, pp = tp_degree(spec.train.layout), pp_degree(spec.train.layout)
        engine = build_engine(spec, model, args.micro_split, tp, pp)
        teacher = load_teacher(spec, manifest.vocab_size, torch.device(engine.device),
                               args.workdir, rank) if spec.distill.teacher else None
        if teacher is not None and pp > 1:  # the last stage's loss is the teacher's
            teach(engine, teacher)
    # a TP group's ranks, a pipeline's stages, read one data replica's batches
    at = pp_ranks(rank, world, pp) if pp > 1 else tp_ranks(rank, world, tp)
    source = make_batches(spec, args.dataset, at.dp_rank, at.dp_world, args.cache("dataset"))
    meter = make_meter(spec, model, manifest.vocab_size, torch.device(engine.device), world,
                       args.cache("device"))

    checkpoints = CheckpointManager(ctx, engine, ctx.checkpoint_every)
    started = start_state(ctx, checkpoints)
    if started is None:  # an operator rollback to a target retention removed: refused
        return end_at_newest(ctx)
    state, restore_s = started
    resume_skipped_documents(ctx, state, source)  # collective: the events' broadcast
    resumed_from = checkpoints.restored[0] if checkpoints.restored else None  # None: fresh
    ctx.progress.write(StartLine(
        resumed_from=resumed_from, world_size=world, params=model.param_count(),
        to_step=args.to_step, attempt=args.attempt, restart=args.restart,
        packing=spec.train.packing,
        flops_per_token=meter.flops_token, peak_tflops=meter.peak / 1e12,
        peak_source=meter.peak_source, restore_s=round(restore_s, 3),
        restore_tier=checkpoints.restored[1] if checkpoints.restored else "",
        checkpoint_every=ctx.checkpoint_every))
    log.info("segment_started", resumed_from=resumed_from, to_step=args.to_step,
             world_size=world, params=model.param_count())
    if resumed_from is None:
        checkpoints.save(state)  # step 0: the fresh run's rollback base

    first, outcome = state.step, SegmentOutcome()
    trainer = build_trainer(ctx, engine, vocab_size=manifest.vocab_size, source=source,
                            meter=meter, checkpoints=checkpoints, outcome=outcome,
                            teacher=teacher)
    state = trainer.train(state)
    if teacher is not None:  # what it cost: a pipeline's last stage alone runs it
        cost = teacher.cost(state.step - first)
        cost = last_stages(engine, cost) if pp > 1 else cost  # collective (pipe group)
        if rank == 0 and ctx.events is not None:
            ctx.events.emit("teacher_cost", cost, step=state.step,
                            event_id=f"teacher_cost/{first}-{state.step}/{args.attempt}")
    ctx.windows.close()
    checkpoints.finish()  # every checkpoint durable before the segment reports success
    if ctx.events is not None:
        ctx.events.flush()  # decisions after the last checkpoint (evaluations) too
    loss = trainer.guard.recent_loss()
    if rank == 0:
        last = checkpoints.last_commit
        write_result(ctx, SegmentResult(
            final_step=state.step, last_committed_step=last[0] if last else None,
            last_committed_uri=last[1] if last else None, train_loss=finite_or_none(loss),
            tokens_seen=state.tokens_seen, steps_run=state.step - first,
            resumed_from=resumed_from, outcome=outcome,
            throughput=meter.summary(torch.device(engine.device)),
            checkpoint_stall_s=round(checkpoints.stall_s, 4), checkpoints=checkpoints.stalls))
    log.info("segment_finished", final_step=state.step, train_loss=loss,
             stopped=outcome.stopped, rollbacks=len(outcome.rollbacks))


def build_trainer(ctx: SegmentContext, engine, *, vocab_size: int, source, meter: Meter,
                  checkpoints: CheckpointManager, outcome: SegmentOutcome,
                  teacher=None) -> Trainer:
    """The step loop's owners for this segment. Fault injection is wired here, once: the
    batch source, the LR windows, a model hook (trainer/faults.py)."""
    spec, args = ctx.spec, ctx.args
    faults = FaultInjector(spec.faults, batches_per_step=spec.train.grad_accum,
                           vocab_size=vocab_size, seed=spec.seed, attempt=args.attempt,
                           events=ctx.events)
    faults.attach(engine.module)
    guard = SpikeGuard(ctx, engine, outcome, checkpoints)
    guard.source = source  # a `data` verdict's accused documents are skipped by it
    batches = faults.batches(source)
    # a rollback's diagnosis replays these, and names the accused documents' sources; a
    # pipeline's replay runs stage by stage (trainer/pipeline_replay.py)
    replayer = PipeReplayer if pp_degree(spec.train.layout) > 1 else Replayer
    guard.replayer = replayer(engine, batches, Sources(args.dataset, args.cache("dataset")))
    # an abnormal loss asks whether the ranks' copies of the weights still agree
    guard.replicas = ReplicaCheck(engine.module, world=ctx.world, zero_stage=spec.train.zero_stage,
                                  rank=ctx.rank, node_rank=ctx.node_rank)
    if tp_degree(spec.train.layout) > 1:  # a TP group's ranks hold different shards, not
        guard.replicas.enabled = False  # copies: only the replay can judge numerics there
    if pp_degree(spec.train.layout) > 1:  # stages hold different layers, not copies: only
        guard.replicas.enabled = False  # the replay can judge numerics there
    # the LR an oscillation lowered stays lowered for its steps (collective: a broadcast)
    guard.oscillation.windows = recorded_lr_windows(ctx)
    schedule = LRSchedule(spec.train, (*args.lr_windows, *guard.oscillation.windows),
                          one_shot=faults.lr_windows())
    guard.oscillation.schedule = schedule
    return Trainer(
        ctx=ctx, engine=engine, batches=batches, meter=meter, lr=schedule,
        probe=StepProbe(ctx, engine), guard=guard, checkpoints=checkpoints, faults=faults,
        evaluator=OnlineEval(ctx, engine, make_val(spec, args.dataset, args.cache("dataset")),
                             guard, outcome),
        stopper=Stopper(StopRules(target=ctx.target, max_rollbacks=args.max_rollbacks,
                                  early_stop_on_overfit=spec.train.early_stop_on_overfit),
                        outcome),
        teacher=teacher)


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
        outcome=SegmentOutcome(stopped=ROLLBACK_REFUSED)))


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
    # windows); inline JSON stays for running a segment by hand.
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
