"""What one segment process knows and shares with its peers: its arguments (`SegmentArgs`),
its spec, rank and stores (`SegmentContext`), rank 0's progress file and event log, the
preemption flag, and the collectives every rank calls at the same points.

The segment's checkpoint state (resume, commit, rollback, uploads) has one owner,
trainer/checkpoint_manager.py; the step loop is trainer/loop.py.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

from common.procs import stop_requested
from common.protocol import OperatorRollback, ProgressLine, launch_tag
from spec import RunSpec
from storage.checkpoints import CheckpointStore
from storage.events import EventLog, read_events
from trainer.tracing import StepWindows


@dataclass(frozen=True)
class SegmentArgs:
    """`python -m trainer.segment`'s arguments, typed (parsed in trainer/segment.py)."""

    spec: str  # the RunSpec JSON file
    dataset: str  # the dataset MANIFEST.json URI
    to_step: int  # train until this global step
    workdir: str  # local directory for progress and results
    fast_dir: str | None = None  # the run's fast-tier store on this machine (default: WORKDIR/ckpt)
    # local copies of the dataset's shards and the event log's batches (None: none kept)
    cache_dir: str | None = None
    attempt: int = 1  # the activity attempt (for events)
    restart: int = 0  # its restarts in place so far (activities/training.py)
    unfinished: bool = False  # the supervisor saw no commit of to_step just before the launch
    lr_windows: tuple[tuple[float, float, float], ...] = ()  # [start, end, factor]
    rollback: OperatorRollback | None = None  # an operator's, applied once per id
    max_rollbacks: int = -1  # end the segment early after this many rollbacks (-1: no limit)
    micro_split: int = 1  # each micro-batch as this many chunks (after an OOM: workflows/adapt.py)
    nnodes: int = 1  # nodes this segment spans (a multi-node gang: workflows/gang.py)
    session: str = ""  # the gang launch's id: its nodes' checkpoint parts carry it
    # steps between checkpoints, as the workflow chose them (train.checkpoint_every
    # "auto", workflows/interval.py); 0: the spec's
    checkpoint_every: int = 0

    @property
    def launch(self) -> str:
        """This launch in event ids: `attempt`, or `attempt.restart` (common/protocol.py)."""
        return launch_tag(self.attempt, self.restart)

    def cache(self, what: str) -> str | None:
        """The local cache of `what` ("dataset", "events") under --cache-dir, if any."""
        return os.path.join(self.cache_dir, what) if self.cache_dir else None


class Progress:
    """A node leader's append-only progress file (common/protocol.py lines), one O_APPEND write per
    line — atomic next to the checkpointer thread's `commit` lines — so the supervisor can
    tail it. It only writes: the step loop feeds the tracing spans itself (trainer/loop.py)."""

    def __init__(self, path: str | None) -> None:
        self.path, self.fd = path, None

    def write(self, line: ProgressLine) -> None:
        if self.path is None:
            return
        if self.fd is None:  # opened once: the step loop pays one write() per line
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self.fd, (line.to_json() + "\n").encode())


SIGNALLED: list[str] = []  # appended to by on_sigterm


def on_sigterm(signum: int, frame: object) -> None:
    """A preemption notice (SLURM, Kubernetes send SIGTERM before SIGKILL): stop at the end
    of the current step with a checkpoint instead of dying mid-step."""
    SIGNALLED.append("SIGTERM (preemption notice)")


class Prefetch:
    """`read()` running in a thread; result() waits for it and returns (or raises) what it
    did."""

    def __init__(self, kinds: tuple[str, ...], read: Callable[[], list[dict]]) -> None:
        self.kinds, self._out, self._error = kinds, [], None
        self._thread = threading.Thread(target=self._run, args=(read,), daemon=True,
                                        name="mainspring-prefetch")
        self._thread.start()

    def _run(self, read: Callable[[], list[dict]]) -> None:
        try:
            self._out = read()
        except BaseException as exc:  # noqa: BLE001 — raised again in the reader's thread
            self._error = exc

    def result(self) -> list[dict]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out


class SegmentContext:
    """What one segment process knows: arguments, spec, rank, stores, and rank 0's outputs."""

    def __init__(self, args: SegmentArgs, spec: RunSpec, rank: int, world: int,
                 config_hash: str = "") -> None:
        self.args, self.spec, self.rank, self.world = args, spec, rank, world
        # the run's spec hash (checkpoint manifests): `spec` may be its elastic form
        self.config_hash = config_hash or spec.spec_hash()
        # torchrun's: this rank on its node, and the node's rank. A node's first rank leads
        # it: the node's progress file, its stop file, its fast tier's checkpointer.
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self.node_rank = int(os.environ.get("GROUP_RANK", 0))
        self.nnodes = args.nnodes
        self.leader = self.local_rank == 0
        self.workdir, self.target = args.workdir, args.to_step
        self.store = CheckpointStore(spec.storage.durable, spec.run_id)
        self.events = None
        if rank == 0:
            traceparent = os.environ.get("TRACEPARENT", "")
            trace_id = traceparent.split("-")[1] if traceparent.count("-") >= 3 else ""
            self.events = EventLog(spec.storage.durable, spec.run_id, "trainer",
                                   attempt=args.attempt, trace_id=trace_id)
        self.windows = StepWindows(rank)  # the step-window spans (the loop adds its lines)
        self.progress = Progress(os.path.join(self.workdir, "progress.jsonl") if self.leader
                                 else None)
        self._prefetched: Prefetch | None = None

    def prefetch_events(self, kinds: tuple[str, ...]) -> None:
        """Start reading the run's events of `kinds` now, on rank 0 in a thread, for the
        start-up's reads (read_events): the listing and fetches overlap the process group,
        engine and dataset set-up instead of following them — on a loaded S3 they cost
        seconds a restart would otherwise wait for."""
        if self.rank == 0:
            self._prefetched = Prefetch(kinds, lambda: read_events(
                self.spec.storage.durable, self.spec.run_id, kinds,
                cache_dir=self.args.cache("events")))

    @property
    def checkpoint_every(self) -> int:
        """Steps between this segment's checkpoints: the workflow's choice, else the spec's
        (with "auto" and no choice - a segment run by hand - its lower bound)."""
        return self.args.checkpoint_every or self.spec.train.first_checkpoint_every

    @cached_property
    def fast_store(self) -> CheckpointStore:
        """The fast tier: the run's local store on this machine (`--fast-dir`, shared by a
        node's ranks and by the run's segments, storage/fast_tier.py), so a retry or the next
        segment on this machine resumes locally."""
        return CheckpointStore.local(self.args.fast_dir or os.path.join(self.workdir, "ckpt"))

    # ---- collectives: every rank calls these at the same points --------------------------
    def comm_device(self) -> torch.device:
        """Where a collective's tensor must live: the current GPU under NCCL, else the CPU."""
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def loss_and_stop(self, loss: torch.Tensor) -> tuple[float, str]:
        """The step's loss collective and host sync: the mean loss over ranks, and why to
        stop after this step ('' to go on) — SIGTERM (a preemption notice) on any
        rank, or the supervisor's stop file, which rank 0 reads — so every rank stops at
        the same step. `loss` stays on the device until here."""
        reason = SIGNALLED[-1] if SIGNALLED else (
            stop_requested(self.workdir) if self.leader else "")  # each node's supervisor
        if self.world == 1:
            return loss.item(), reason  # sync point: the step's loss to the host
        flag = torch.tensor(1.0 if reason else 0.0, device=loss.device)
        both = torch.stack([loss.detach().float().reshape(()), flag]).to(self.comm_device())
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        both[0] /= self.world
        mean, stops = both.tolist()  # sync point: loss and stop flag to the host, together
        if not reason and stops > 0:
            reason = "stop requested on another rank"
        return mean, reason

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def read_events(self, kinds: tuple[str, ...]) -> list[dict]:
        """The run's events of `kinds`, read on rank 0 through the local cache (or taken from
        the prefetch when it covers them), broadcast."""
        def read() -> list[dict]:
            pre = self._prefetched
            if pre is not None and set(kinds) <= set(pre.kinds):
                return [e for e in pre.result() if e["kind"] in kinds]
            return read_events(self.spec.storage.durable, self.spec.run_id, kinds,
                               cache_dir=self.args.cache("events"))
        return self.from_rank0(read)

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
