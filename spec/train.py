"""RunSpec's `train` section: steps and segments, batch, optimizer and LR schedule, precision,
ZeRO, checkpoint cadence and online evaluation. Read by the trainer (trainer/engine.py builds
the DeepSpeed config and the LR schedule from it, trainer/loop.py runs the loop) and by
the workflow (segments, continue-as-new). Stdlib only; re-exported by spec."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from spec.codec import STEPS, num
from spec.codec import positive as _positive
from spec.codec import require as _require
from spec.layout import ClusterConfig, LayoutConfig

LAYOUT_WORDS = ("dp", "auto")

MAX_NODES = 4096  # the largest cluster a spec may ask for


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # Added fields, with the default they came with: out of spec_hash at that default
    # (spec/run.py), so a run claimed before they existed keeps its hash.
    ADDED: ClassVar[dict[str, Any]] = {"min_nodes": 0, "checkpoint_every_min": 10,
                                       "init_from": "", "layout": "dp",
                                       "cluster": {"accelerator": "cpu", "memory_gb": 0.0,
                                                   "intra_node_gbps": 0.0,
                                                   "inter_node_gbps": 0.0}}

    total_steps: int = num(200, 1, STEPS)
    segment_steps: int = num(100, 1, STEPS)  # steps per train_segment activity
    # continue-as-new after this many segments (history bound)
    segments_per_run: int = num(4, 1, 1000)
    # tokens per rank per micro-batch (multiple of seq_len)
    micro_batch_tokens: int = num(1024, 1, 1 << 30)
    grad_accum: int = num(1, 1, 1 << 16)
    lr: float = num(3e-3, 0, 10, lo_open=True)
    min_lr: float = num(3e-4, 0, 10)
    warmup_steps: int = num(20, 0, STEPS - 1)  # below total_steps, itself at most STEPS
    weight_decay: float = num(0.1, 0, 10)
    betas: tuple[float, float] = num((0.9, 0.95), 0, 1, hi_open=True)
    eps: float = num(1e-8, 0, 1, lo_open=True)
    grad_clip: float = num(1.0, 0, 1e6)
    precision: str = "fp32"  # fp32 | bf16 | fp16
    zero_stage: int = num(0, 0, 3)
    # Nodes a segment spans (docs/multinode.md): one trainer worker per node, gang-scheduled
    # by the workflow (workflows/gang.py). More than MAX_NODES is not a cluster anyone has.
    nodes: int = num(1, 1, MAX_NODES, why="larger than any cluster this runs on")
    # Elastic: with fewer healthy nodes than `nodes` for ops.node_wait_s, the run goes on
    # with fewer - a divisor of `nodes` >= min_nodes - and the same global batch (gradient
    # accumulation x nodes / nodes used; the ZeRO <= 2 checkpoint is resharded). 0: `nodes`.
    min_nodes: int = num(0, 0, MAX_NODES)
    procs_per_node: int = num(1, 1, 1024)
    # Steps between checkpoints (and one at each segment's end), or "auto": the workflow
    # chooses it at each segment by Young-Daly, sqrt(2 x checkpoint stall x MTBF), from this
    # run's measured checkpoint stalls and step time and the faults it has seen (a prior of
    # ops.mtbf_s until ops.mtbf_prior_faults are seen), within [checkpoint_every_min,
    # segment_steps], and records each choice as a `checkpoint_interval` event
    # (workflows/interval.py). Before a checkpoint is measured: checkpoint_every_min.
    checkpoint_every: int | str = num(25, 1, STEPS, words=("auto",))
    checkpoint_every_min: int = num(10, 1, STEPS)  # "auto"'s lower bound, in steps
    eval_batches: int = num(8, 1, 10**6)  # validation micro-batches per evaluation
    packing: bool = True  # pack whole documents into rows (False: fixed windows of the stream)
    # fp16 dynamic loss scaling (DeepSpeed): start at 2**power, double after `window`
    # overflow-free steps, halve after `hysteresis` overflows, never below `min_loss_scale`.
    fp16_initial_scale_power: int = num(16, 0, 32)
    fp16_loss_scale_window: int = num(1000, 1, 10**9)
    fp16_hysteresis: int = num(2, 1, 10**6)
    fp16_min_loss_scale: float = num(1.0, 0, 2.0**32, lo_open=True)
    overlap_comm: bool = False  # overlap gradient reduction with backward (ZeRO >= 1)
    contiguous_gradients: bool = True  # copy gradients into one buffer (less fragmentation)
    reduce_bucket_size: int = num(500_000_000, 1, 1 << 40)  # elements per gradient reduce bucket
    allgather_bucket_size: int = num(500_000_000, 1, 1 << 40)  # elements per all-gather bucket
    peak_tflops: float = num(0.0, 0, 1e6)  # per-device peak for MFU; 0 = measure with a probe
    # Online evaluation inside the segment: held-out loss every `eval_every` steps (0 = off).
    # Validation rising while training loss falls for `overfit_evals` evaluations in a row
    # raises an `overfitting` event; `early_stop_on_overfit` also ends training there.
    eval_every: int = num(0, 0, STEPS)
    overfit_evals: int = num(3, 1, 10**6)
    early_stop_on_overfit: bool = False
    # Start from another run's promoted checkpoint in the same durable store: "RUN_ID" (its
    # newest promoted step) or "RUN_ID@STEP". Weights only (the optimizer starts fresh),
    # read weights-only and verified against its manifest; the model's shape and the
    # dataset's tokenizer must match the source's (storage/init_source.py). "": from scratch.
    init_from: str = ""
    # How the model is laid across the world (spec/layout.py, docs/runspec.md): "dp", data
    # parallel over every rank with zero_stage (what runs today); {"tp", "pp", "zero"}
    # explicit degrees, checked against the model and world by RunSpec; "auto", the
    # planner's choice (spec/layout.py plan_layout). TP above 1 trains (ZeRO 0-2, not
    # elastic, no sweep); PP above 1 trains alone (tp 1, ZeRO 0-1, fp32, not elastic, no
    # sweep: trainer/pipeline.py); "auto" is planned when the spec is read
    # (spec/layout.py planned_layout, for `cluster`) and the spec holds what it came to.
    layout: str | LayoutConfig = "dp"
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # what "auto" plans for

    def __post_init__(self) -> None:
        _positive(self, "total_steps", "segment_steps", "segments_per_run", "micro_batch_tokens",
                  "grad_accum", "lr", "checkpoint_every_min", "nodes", "procs_per_node",
                  "eval_batches", "eps", "fp16_loss_scale_window", "fp16_hysteresis",
                  "fp16_min_loss_scale", "reduce_bucket_size", "allgather_bucket_size")
        every = self.checkpoint_every
        _require(every == "auto" or (not isinstance(every, str) and every > 0),
                 "checkpoint_every", f"must be > 0 or \"auto\", got {every!r}",
                 'set checkpoint_every to a positive number of steps, or "auto"')
        _require(0 <= self.fp16_initial_scale_power <= 32, "fp16_initial_scale_power",
                 f"must be in [0, 32], got {self.fp16_initial_scale_power}", "use e.g. 16")
        _require(2.0 ** self.fp16_initial_scale_power >= self.fp16_min_loss_scale,
                 "fp16_min_loss_scale", "is above the initial scale 2**fp16_initial_scale_power",
                 "lower fp16_min_loss_scale or raise fp16_initial_scale_power")
        _require(not self.overlap_comm or self.zero_stage >= 1, "overlap_comm",
                 "has nothing to overlap at zero_stage 0", "use zero_stage >= 1 or overlap_comm=false")
        _require(self.peak_tflops >= 0, "peak_tflops", "must be >= 0", "use 0 to measure it")
        _require(0 <= self.min_lr <= self.lr, "min_lr", "must be in [0, lr]", "lower min_lr")
        _require(0 <= self.warmup_steps < self.total_steps, "warmup_steps",
                 "must be in [0, total_steps)", "lower warmup_steps")
        _require(self.precision in ("fp32", "bf16", "fp16"), "precision",
                 f"unknown precision {self.precision!r}", "use fp32, bf16 or fp16")
        _require(self.zero_stage in (0, 1, 2, 3), "zero_stage",
                 f"must be 0..3, got {self.zero_stage}", "use a ZeRO stage between 0 and 3")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
                 f"must be two numbers in [0, 1), got {self.betas}", "use e.g. [0.9, 0.95]")
        _require(self.grad_clip >= 0, "grad_clip", "must be >= 0", "use 0 to disable")
        _require(self.weight_decay >= 0, "weight_decay", "must be >= 0", "use e.g. 0.1")
        _require(self.eval_every >= 0, "eval_every", "must be >= 0", "use 0 to turn it off")
        _positive(self, "overfit_evals")
        _require(self.nodes <= MAX_NODES, "nodes",
                 f"{self.nodes} nodes is larger than any cluster this runs on (at most "
                 f"{MAX_NODES})", f"use at most {MAX_NODES} nodes, more processes per node")
        _require(self.min_nodes <= self.nodes, "min_nodes",
                 f"must be <= nodes ({self.nodes}), got {self.min_nodes}",
                 "set min_nodes between 1 and nodes, or 0 (not elastic)")
        _require(self.min_nodes == 0 or self.nodes % self.min_nodes == 0, "min_nodes",
                 f"{self.min_nodes} does not divide nodes ({self.nodes}): on fewer nodes the "
                 "global batch is kept by accumulating nodes/nodes_used times more",
                 "use a divisor of nodes")
        _require(self.min_nodes in (0, self.nodes) or self.zero_stage <= 2, "min_nodes",
                 "a ZeRO-3 checkpoint cannot be resharded to fewer nodes here",
                 "use zero_stage <= 2, or min_nodes 0")
        _require(not isinstance(self.layout, str) or self.layout in LAYOUT_WORDS, "layout",
                 f"unknown layout {self.layout!r}",
                 'use "dp", "auto" or {"tp": 1, "pp": 1, "zero": 0}')
        if self.init_from:
            init_source(self.init_from)  # its form; whether it fits: storage/init_source.py
            _require(self.zero_stage <= 2, "init_from",
                     "loading another run's weights into ZeRO-3's partitioned parameters is "
                     "not supported", "use zero_stage <= 2, or start from scratch")

    @property
    def auto_checkpoint(self) -> bool:
        return self.checkpoint_every == "auto"

    @property
    def first_checkpoint_every(self) -> int:
        """The interval before the workflow has chosen one: the spec's number, or with
        "auto" the lower bound (no checkpoint measured yet; workflows/interval.py)."""
        every = self.checkpoint_every
        return self.checkpoint_every_min if isinstance(every, str) else every

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def fewest_nodes(self) -> int:
        return self.min_nodes or self.nodes

    def node_counts(self) -> list[int]:
        """The node counts a segment may run on, most first: divisors of `nodes` down to
        `fewest_nodes` (the global batch stays whole at each)."""
        return [n for n in range(self.nodes, self.fewest_nodes - 1, -1) if self.nodes % n == 0]


INIT_FROM_RE = re.compile(r"([a-z0-9][a-z0-9-]{0,62})(?:@(\d{1,15}))?")  # run id as spec/run.py


def init_source(text: str) -> tuple[str, int | None]:
    """Pure: `train.init_from` as (run id, step or None for its newest promoted step);
    BadConfig naming the field when it is neither "RUN_ID" nor "RUN_ID@STEP"."""
    m = INIT_FROM_RE.fullmatch(text)
    _require(m is not None, "init_from", f"{text[:80]!r} is not RUN_ID or RUN_ID@STEP",
             'name a run of this durable store, e.g. "base-run" or "base-run@4000"')
    assert m is not None
    return m.group(1), int(m.group(2)) if m.group(2) else None
