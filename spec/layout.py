"""How the model is laid across accelerators: tensor (TP), pipeline (PP) and data (DP)
parallel degrees and the ZeRO stage — the planner `plan_layout`, a run's `"auto"` through it
(`planned_layout`, for `train.cluster`) and the checks on `train.layout` (`check_layout`).
Pure and stdlib only: the workflow sandbox imports spec.

The planner follows Megatron-LM's rule of thumb (Narayanan et al. 2021, arXiv 2104.04473,
takeaway 1): tensor parallelism up to the accelerators of one server, whose links are fast
(NVLink), then pipeline parallelism across servers, whose links are slow; data parallelism
takes the rest. Its memory model, per accelerator:

- model states: 16 bytes per parameter with Adam in mixed precision — bf16 weights (2) and
  gradients (2), fp32 master weights, momentum and variance (4 + 4 + 4) (ZeRO, Rajbhandari
  et al. 2019, arXiv 1910.02054, section 3.1). ZeRO-1 shards the 12 optimizer bytes over
  the data-parallel ranks, ZeRO-2 the gradients too, ZeRO-3 all 16 (section 5.1).
- activations: 34 bytes per token per layer per hidden unit in 16-bit, divided by TP with
  sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198, section 4, equation 5
  without the 5·a·s/h attention-score term, which flash attention does not store). Full
  recompute keeps 2 bytes per token per hidden unit per layer (each layer's input) plus
  one layer's working set. With 1F1B the first stage holds `pp` micro-batches of its
  n_layers/pp layers: n_layers layers' worth of one micro-batch at any pp (arXiv
  2104.04473, section 2.2.1).
- the states may take half an accelerator; the other half is for activations, buffers
  and fragmentation (an assumption, the same as `mainspring plan`'s ops/plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.errors import BadConfig
from common.limits import MAX_BATCH_TOKENS
from spec.codec import num
from spec.codec import require as _require
from spec.hardware import ACCELERATORS
from spec.model import ModelConfig, param_count

if TYPE_CHECKING:
    from spec.train import TrainConfig

STATE_BYTES = 16  # bytes per parameter, Adam in mixed precision (arXiv 1910.02054, 3.1)
WEIGHT_BYTES = 2  # bf16 weights; also bf16 gradients
OPTIMIZER_BYTES = 12  # fp32 master weights, Adam momentum and variance
ACTIVATION_BYTES = 34  # per token, layer and hidden unit, 16-bit (arXiv 2205.05198, eq. 5)
RECOMPUTE_BYTES = 2  # per token, layer and hidden unit kept under full recompute
STATE_SHARE = 0.5  # of an accelerator's memory the model states may take (assumption)
GB = 1e9

TRAINED_TODAY = ("tp above 1 trains inside a node (ZeRO 0-2); pp above 1 trains alone (tp 1, "
                 "ZeRO 0-1, fp32, not elastic, no sweep)")
# What tp above 1 does not have yet (docs/decisions.md 89 and after): ZeRO 3 under TP is
# not measured here (its checkpoints would hold partitions of shards, which the weights
# readers do not reassemble); a checkpoint's TP shards are not resharded to another world
# (elastic); the sweep counts world_size replicas in its batch and budget.
TP_ZERO = "ZeRO 3 under TP is not built here (exact resume and evaluation measured at 0-2)"
TP_ELASTIC = "a TP run's checkpoint is not resharded to fewer nodes (elastic) yet"
TP_SWEEP = "the sweep counts every rank as a data replica; with TP it would not be one"
# What pp above 1 does not have yet (docs/decisions.md 94): TP and PP together (DeepSpeed's
# 3D grid with AutoTP is not built here); a stage's layer files are not repartitioned to
# another world (elastic); the sweep's replica count; bf16/fp16 (in bf16 the pipe engine
# takes DeepSpeed's BF16_Optimizer, whose checkpoint does not load back here: a resume
# fails in its load_state_dict).
PP_TP = "TP and PP together (DeepSpeed's 3D grid with AutoTP) are not built here"
PP_ELASTIC = "a pipeline's stages are not repartitioned to fewer nodes (elastic)"
PP_SWEEP = "the sweep counts every rank as a data replica; with PP it would not be one"
PP_PRECISION = ("the pipeline engine's bf16 optimizer (DeepSpeed's BF16_Optimizer) does not "
                "resume its own checkpoint here, and fp16 needs CUDA")


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    """An explicit `train.layout`: tensor and pipeline degrees and the ZeRO stage; and where
    the planner chose them (`"auto"`, `planned`), its reasons, so the run's record says why."""

    tp: int = num(1, 1, 1024)  # tensor-parallel degree, inside a node
    pp: int = num(1, 1, 1024)  # pipeline stages, across nodes
    zero: int = num(0, 0, 3)  # ZeRO stage; must equal train.zero_stage (the trainer reads it)
    why: tuple[str, ...] = ()  # the planner's sentences; empty for a layout written out

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}",
                     f"set {name} to 1 (no {name.upper()}) or more")
        _require(self.zero in (0, 1, 2, 3), "zero", f"must be 0..3, got {self.zero}",
                 "use a ZeRO stage between 0 and 3")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The cluster `train.layout: "auto"` plans for (`train.cluster`): an accelerator class of
    spec/hardware.py and, where this cluster's own figures differ, its memory and links;
    0 takes the class's figure (each with its source there). Nodes and accelerators per
    node are `train.nodes` and `train.procs_per_node`."""

    accelerator: str = "cpu"
    memory_gb: float = num(0.0, 0, 1e6)  # per accelerator
    intra_node_gbps: float = num(0.0, 0, 1e6)  # GB/s per accelerator, one direction
    inter_node_gbps: float = num(0.0, 0, 1e6)

    def __post_init__(self) -> None:
        _require(self.accelerator in ACCELERATORS, "accelerator",
                 f"unknown accelerator {self.accelerator!r}",
                 f"use one of {', '.join(ACCELERATORS)}, and memory_gb and the link speeds "
                 "for one that differs")

    def figures(self) -> tuple[float, float, float]:
        """(memory GB, intra-node GB/s, inter-node GB/s): the cluster's, else its class's."""
        acc = ACCELERATORS[self.accelerator]
        return (self.memory_gb or acc.memory_gb, self.intra_node_gbps or acc.intra_gbs,
                self.inter_node_gbps or acc.inter_gbs)


@dataclass(frozen=True, kw_only=True)
class Trains:
    """What the trainer can run, as bounds on the planner's choice (`trains_today`); the
    defaults bound nothing (a plan for any framework, as the published recipes)."""

    max_tp: int = 1 << 20
    max_pp: int = 1 << 20
    tp_with_pp: bool = True
    tp_max_zero: int = 3
    min_zero: int = 0
    max_zero: int = 3  # 2 where a ZeRO-3 checkpoint could not be used (elastic, init_from)
    why: str = ""  # the sentence naming what set a bound, for the planner's reasons


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The planner's answer, each choice with the sentence that made it."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batch: int  # sequences per micro-batch
    activation_recompute: bool
    reasons: tuple[str, ...]


def tp_degree(layout: str | LayoutConfig) -> int:
    """The tensor-parallel degree a `train.layout` asks for: 1 for "dp" ("auto" is a
    LayoutConfig once the spec is read: `planned_layout`)."""
    return layout.tp if isinstance(layout, LayoutConfig) else 1


def pp_degree(layout: str | LayoutConfig) -> int:
    """The pipeline stages a `train.layout` asks for: 1 for "dp"."""
    return layout.pp if isinstance(layout, LayoutConfig) else 1


def divisors(n: int) -> list[int]:
    """Pure: the divisors of `n`, ascending, in O(sqrt n): each d up to sqrt(n) with its
    partner n // d (a planner's search over them is bounded by MAX_BATCH_TOKENS)."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


def state_bytes_per_param(zero: int, dp: int) -> float:
    """Model-state bytes per parameter of a model-parallel shard on one rank."""
    if zero == 0:
        return STATE_BYTES
    if zero == 1:
        return 2 * WEIGHT_BYTES + OPTIMIZER_BYTES / dp
    if zero == 2:
        return WEIGHT_BYTES + (WEIGHT_BYTES + OPTIMIZER_BYTES) / dp
    return STATE_BYTES / dp


def activation_gb(n_layers: int, d_model: int, tokens: int, tp: int, recompute: bool) -> float:
    """Activation memory of the first stage for one micro-batch of `tokens` (see module)."""
    if recompute:
        kept = RECOMPUTE_BYTES * n_layers + ACTIVATION_BYTES
    else:
        kept = ACTIVATION_BYTES * n_layers
    return kept * d_model * tokens / tp / GB


def tensor_degree(params: float, n_heads: int, n_kv_heads: int, per_node: int,
                  memory_gb: float, trains: Trains = Trains()) -> tuple[int, str]:
    """1 while the bf16 weights fit in half an accelerator; else every accelerator of a
    node that divides the heads and the kv heads (arXiv 2104.04473, takeaway 1), up to
    what the trainer runs (`trains.max_tp`)."""
    weights_gb = WEIGHT_BYTES * params / GB
    if weights_gb <= STATE_SHARE * memory_gb:
        return 1, (f"TP 1: the bf16 weights ({weights_gb:.1f} GB) fit in half an "
                   f"accelerator ({memory_gb:g} GB)")
    tp = max(t for t in divisors(per_node) if n_heads % t == 0 and n_kv_heads % t == 0
             and t <= trains.max_tp)
    if tp == 1:
        return 1, (f"TP 1: the bf16 weights ({weights_gb:.1f} GB) do not fit in half an "
                   f"accelerator ({memory_gb:g} GB), but {trains.why or 'no TP degree fits'}")
    return tp, (f"TP {tp}: the bf16 weights ({weights_gb:.1f} GB) do not fit in half an "
                f"accelerator, so the matrices are split over the node's fast links "
                f"({per_node} accelerators; {tp} divides {n_heads} heads and "
                f"{n_kv_heads} kv heads)")


@dataclass(frozen=True, kw_only=True)
class _Option:
    pp: int
    zero: int
    dp: int
    state_gb: float
    fits: bool
    sync_s: float  # data-parallel traffic per step on the inter-node link
    slow: bool  # that traffic takes longer than the step's compute


def dp_bytes_per_param(zero: int, dp: int) -> float:
    """Data-parallel bytes per parameter of a shard, per rank and step: a ring all-reduce of
    bf16 gradients sends 2(G-1)/G of them (ZeRO 0-2; ZeRO-1/2 reduce-scatter and all-gather
    the same volume); ZeRO-3 gathers the parameters again for backward: 1.5x (arXiv
    1910.02054, section 7)."""
    ring = 2 * WEIGHT_BYTES * (dp - 1) / dp
    return 1.5 * ring if zero == 3 else ring


def _options(params: float, n_layers: int, tp: int, nodes: int, world: int, sequences: int,
             memory_gb: float, max_zero: int, inter_gbps: float, compute_s: float,
             trains: Trains = Trains()) -> list[_Option]:
    out = []
    max_pp = trains.max_pp if tp == 1 or trains.tp_with_pp else 1
    max_zero = min(max_zero, trains.max_zero)
    if tp > 1:
        max_zero = min(max_zero, trains.tp_max_zero)
    for pp in divisors(n_layers):
        if pp > nodes or world % (tp * pp) or sequences < world // (tp * pp) * pp \
                or pp > max_pp:
            continue  # stages across nodes; a whole world; >= pp micro-batches per DP rank
        dp = world // (tp * pp)
        for zero in range(trains.min_zero, min(max_zero, 1 if pp > 1 else 3) + 1):
            shard = params / (tp * pp)
            state = state_bytes_per_param(zero, dp) * shard / GB
            sync_s = dp_bytes_per_param(zero, dp) * shard / (inter_gbps * GB) if nodes > 1 else 0
            out.append(_Option(pp=pp, zero=zero, dp=dp, state_gb=state,
                               fits=state <= STATE_SHARE * memory_gb, sync_s=sync_s,
                               slow=sync_s > compute_s))
    return out


def plan_layout(*, params: float, n_layers: int, n_heads: int, n_kv_heads: int, d_model: int,
                nodes: int, accelerators_per_node: int, accelerator_memory_gb: float,
                intra_node_gbps: float, inter_node_gbps: float, seq_len: int,
                global_batch_tokens: int, accelerator_tflops: float, mfu: float = 0.4,
                max_zero: int = 3, trains: Trains = Trains()) -> Layout:
    """Pure: (tp, pp, dp, ZeRO stage, micro-batch, recompute) for a model on a cluster, with
    the sentences that chose them. Bandwidths are GB/s per accelerator, one direction;
    `mfu` turns the peak into the compute time the data-parallel traffic must hide behind
    (0.4: Llama 3's 400 TFLOP/s per H100, arXiv 2407.21783 table 4); `max_zero`: the
    highest ZeRO stage the framework offers (0 for Megatron-LM before its distributed
    optimizer); `trains`: what the trainer runs (`trains_today`), for a run's "auto".

    TP from `tensor_degree` (the intra-node link is where TP goes; its bandwidth is
    reported, not compared). Then the fewest pipeline stages (a divisor of n_layers, at
    most one per node, >= pp micro-batches per data-parallel rank) and the lowest ZeRO
    stage (<= 1 with pipelines: DeepSpeed's pipeline engine refuses 2 and 3) whose states
    fit in half an accelerator and whose data-parallel traffic per step on the inter-node
    link takes no longer than the step's compute. When nothing does: the layout with the
    least state, said so."""
    _require(global_batch_tokens <= MAX_BATCH_TOKENS, "global_batch_tokens",
             f"{global_batch_tokens:,} tokens a step is over the {MAX_BATCH_TOKENS:,} the "
             "planner plans for", "plan a smaller global batch")
    world = nodes * accelerators_per_node
    sequences = global_batch_tokens // seq_len
    tp, tp_why = tensor_degree(params, n_heads, n_kv_heads, accelerators_per_node,
                               accelerator_memory_gb, trains)
    reasons = [f"{tp_why}, {intra_node_gbps:g} GB/s each" if tp > 1 else tp_why]
    flops = (6 * params + 12 * n_layers * d_model * seq_len) * global_batch_tokens  # PaLM app. B
    compute_s = flops / (world * accelerator_tflops * 1e12 * mfu)
    options = _options(params, n_layers, tp, nodes, world, sequences, accelerator_memory_gb,
                       max_zero, inter_node_gbps, compute_s, trains)
    bounded = trains != Trains()
    _require(bool(options), "layout", f"no pipeline degree of {n_layers} layers splits "
             f"{world} accelerators with TP {tp} and {sequences} sequences per step"
             + (f" at ZeRO {trains.min_zero} or above within what trains ({TRAINED_TODAY})"
                if bounded else ""),
             "change the node count or the global batch"
             + (", or lower train.zero_stage (auto plans no stage below it)"
                if bounded and trains.min_zero else ""))
    good = [o for o in options if o.fits and not o.slow]
    pick = good[0] if good else min(options, key=lambda o: (o.state_gb, o.slow))
    slow = next((o for o in options if o.fits and o.slow and o.pp < pick.pp), None)
    if slow:
        reasons.append(f"with PP {slow.pp} the data-parallel traffic ({slow.sync_s:.1f} s per "
                       f"step at {inter_node_gbps:g} GB/s) outruns the step's "
                       f"{compute_s:.1f} s of compute: the slow link calls for pipelines")
    if pick.pp > 1:
        reasons.append(f"PP {pick.pp}: the fewest stages dividing {n_layers} layers whose "
                       f"states ({pick.state_gb:.1f} GB per accelerator with ZeRO "
                       f"{pick.zero}) fit in half of {accelerator_memory_gb:g} GB and whose "
                       f"gradient traffic ({pick.sync_s:.1f} s) the compute hides; stages "
                       f"across nodes, over {inter_node_gbps:g} GB/s")
    else:
        reasons.append(f"PP 1: the states fit with ZeRO {pick.zero} ({pick.state_gb:.1f} GB "
                       f"per accelerator), their traffic ({pick.sync_s:.1f} s per step) "
                       f"under the {compute_s:.1f} s of compute")
    if not pick.fits:
        reasons.append(f"nothing fits half of {accelerator_memory_gb:g} GB: the layout with "
                       f"the least state ({pick.state_gb:.1f} GB), with activations recomputed")
    if not pick.fits:
        reasons.append(f"ZeRO {pick.zero}: the most sharding offered")
    elif pick.pp > 1:
        reasons.append(f"ZeRO {pick.zero}: the lowest stage that fits (at most 1 with "
                       "pipelines: DeepSpeed refuses 2 and 3)")
    else:
        reasons.append(f"ZeRO {pick.zero}: the lowest stage that fits")
    reasons.append(f"DP {pick.dp} = {world} accelerators / (TP {tp} x PP {pick.pp})")
    micro, recompute, why = _micro_batch(pick, sequences, seq_len, n_layers, d_model, tp,
                                         accelerator_memory_gb)
    reasons.append(why)
    return Layout(tp=tp, pp=pick.pp, dp=pick.dp, zero_stage=pick.zero, micro_batch=micro,
                  activation_recompute=recompute, reasons=tuple(reasons))


def _micro_batch(pick: _Option, sequences: int, seq_len: int, n_layers: int, d_model: int,
                 tp: int, memory_gb: float) -> tuple[int, bool, str]:
    """The largest micro-batch (sequences) dividing a DP rank's share, leaving >= pp
    micro-batches, whose activations fit beside the states; else 1 sequence, recomputed."""
    per_rank = sequences // pick.dp
    room = memory_gb - pick.state_gb
    for b in sorted(divisors(per_rank), reverse=True) if pick.fits else ():
        fits = activation_gb(n_layers, d_model, b * seq_len, tp, recompute=False) <= room
        if per_rank // b >= pick.pp and fits:
            stages = f" (>= {pick.pp} for 1F1B)" if pick.pp > 1 else ""
            return b, False, (f"micro-batch {b} sequence(s): {per_rank // b} per step per DP "
                              f"rank{stages}, activations fit beside the states")
    need = activation_gb(n_layers, d_model, seq_len, tp, recompute=False)
    if need > room:
        why = f"one sequence's activations ({need:.1f} GB) exceed the {room:.1f} GB left"
    else:
        why = "the states leave no margin"
    return 1, True, f"micro-batch 1 sequence with activation recompute: {why}"


def check_layout(layout: LayoutConfig, *, n_heads: int, n_kv_heads: int, n_layers: int,
                 nodes: int, procs_per_node: int, node_counts: list[int], zero_stage: int,
                 grad_accum: int, sweep: bool = False, precision: str = "fp32") -> None:
    """BadConfig, naming the `train.layout` field and the fix, for a layout that cannot run
    on this model and world; last, what the trainer does not do yet: tp above 1 with ZeRO
    3, elastic nodes or a sweep; pp above 1 with tp, elastic nodes, a sweep or bf16/fp16."""
    tp, pp, world = layout.tp, layout.pp, nodes * procs_per_node
    f = "train.layout"
    _require(layout.zero == zero_stage, f"{f}.zero", f"ZeRO {layout.zero} differs from "
             f"train.zero_stage={zero_stage} (the trainer reads train.zero_stage)",
             f"set train.zero_stage to {layout.zero} too, or layout.zero to {zero_stage}")
    _require(tp <= procs_per_node, f"{f}.tp", f"TP {tp} is above train.procs_per_node="
             f"{procs_per_node}: tensor parallelism must stay inside a node's fast links",
             f"use tp <= {procs_per_node}, and pp or more nodes for the rest")
    # n_kv_heads divides n_heads (spec/model.py), so a tp dividing the kv heads divides both
    _require(n_kv_heads % tp == 0, f"{f}.tp", f"TP {tp} does not divide model.n_kv_heads="
             f"{n_kv_heads} (nor so the n_heads={n_heads} query heads in whole groups)",
             f"use a tp dividing {n_kv_heads}: {_listing(divisors(n_kv_heads), procs_per_node)}")
    _require(n_layers % pp == 0, f"{f}.pp", f"PP {pp} does not divide model.n_layers="
             f"{n_layers} (each stage holds the same number of layers)",
             f"use a pp dividing {n_layers}: {_listing(divisors(n_layers), nodes)}")
    _require(world % (tp * pp) == 0, f"{f}", f"TP {tp} x PP {pp} = {tp * pp} does not divide "
             f"the world of {world} (train.nodes x train.procs_per_node)",
             "make tp x pp divide nodes x procs_per_node")
    fewer = [n for n in node_counts if (n * procs_per_node) % (tp * pp)]
    _require(not fewer, "train.min_nodes", f"on {fewer[0] if fewer else 0} nodes the world "
             f"does not split into TP {tp} x PP {pp} groups", "raise min_nodes, or 0")
    _require(pp == 1 or zero_stage <= 1, f"{f}.pp", f"PP {pp} with ZeRO {zero_stage}: "
             "DeepSpeed's pipeline engine refuses ZeRO 2 and 3",
             "use zero_stage 0 or 1 with pp above 1")
    _require(pp == 1 or grad_accum >= pp, "train.grad_accum", f"{grad_accum} micro-batches "
             f"for {pp} stages: 1F1B needs at least as many micro-batches as stages",
             f"set grad_accum >= {pp}")
    if pp > 1:
        _check_pp(pp, tp, node_counts, sweep, precision)
    if tp == 1:
        return
    _require(zero_stage <= 2, f"{f}.zero", f"TP {tp} with ZeRO {zero_stage}: {TP_ZERO}",
             "use zero_stage 2 (gradients and optimizer states sharded over the replicas)")
    _require(len(node_counts) == 1, "train.min_nodes", f"TP {tp} with elastic nodes "
             f"({node_counts}): {TP_ELASTIC}", "set min_nodes to 0 (or to train.nodes)")
    _require(not sweep, "sweep.enabled", f"TP {tp} with a sweep: {TP_SWEEP}",
             "sweep with layout \"dp\" and train the winner with tp, or set enabled=false")


def _check_pp(pp: int, tp: int, node_counts: list[int], sweep: bool, precision: str) -> None:
    """What pp above 1 does not run with yet, each naming its field and the fix."""
    _require(tp == 1, "train.layout", f"TP {tp} x PP {pp}: {PP_TP}",
             "use tp or pp, not both: tp inside a node, or pp with tp 1")
    _require(len(node_counts) == 1, "train.min_nodes", f"PP {pp} with elastic nodes "
             f"({node_counts}): {PP_ELASTIC}", "set min_nodes to 0 (or to train.nodes)")
    _require(not sweep, "sweep.enabled", f"PP {pp} with a sweep: {PP_SWEEP}",
             "sweep with layout \"dp\" and train the winner with pp, or set enabled=false")
    _require(precision == "fp32", "train.precision", f"PP {pp} in {precision}: {PP_PRECISION}",
             "use precision fp32 with pp above 1")


def trains_today(train: TrainConfig, sweep: bool) -> Trains:
    """What the trainer runs (TRAINED_TODAY) as bounds on the planner, for `"auto"`: TP and
    PP only on a fixed node count and without a sweep, PP only in fp32 with at least as
    many micro-batches (`grad_accum`) as stages, not TP and PP together, ZeRO at most 2
    under TP; and never below the run's own `zero_stage`."""
    elastic = len(train.node_counts()) > 1
    # a ZeRO-3 checkpoint is not resharded to fewer nodes, and another run's weights are
    # not loaded into ZeRO-3's partitions (spec/train.py): "auto" plans no stage TrainConfig
    # would then refuse
    max_zero = 2 if elastic or train.init_from else 3
    why = ("a run with elastic nodes (train.min_nodes) trains data parallel only" if elastic
           else "a sweep trains data parallel only (sweep.enabled)" if sweep else "")
    if why:
        return Trains(max_tp=1, max_pp=1, min_zero=train.zero_stage, max_zero=max_zero,
                      why=why)
    pp = train.grad_accum if train.precision == "fp32" else 1
    return Trains(max_tp=1 << 20, max_pp=pp, tp_with_pp=False, tp_max_zero=2,
                  min_zero=train.zero_stage, max_zero=max_zero, why="")


def planned_layout(train: TrainConfig, model: ModelConfig, vocab_size: int,
                   sweep: bool) -> LayoutConfig:
    """`train.layout: "auto"`: the planner's layout for this model on `train.cluster`'s
    accelerators (`train.nodes` x `train.procs_per_node`), bounded by what the trainer
    runs, with its reasons. BadConfig, before any process starts, when no layout's model
    states fit half an accelerator, or the run's own micro-batch does not fit beside them.

    The batch is the run's: `micro_batch_tokens` x `grad_accum` per data replica (the
    planner's compute time is taken at the whole world as replicas). The planner's own
    micro-batch is advice; the run keeps `micro_batch_tokens`, checked here instead."""
    batch = train.micro_batch_tokens * train.grad_accum * train.world_size
    _require(batch <= MAX_BATCH_TOKENS, "train.micro_batch_tokens",
             f'"auto" plans global batches up to {MAX_BATCH_TOKENS:,} tokens a step (2^36); '
             f"{train.micro_batch_tokens} tokens x grad_accum {train.grad_accum} x "
             f"{train.world_size} ranks is {batch:,}",
             "lower micro_batch_tokens or grad_accum (Llama 3 trains 16M tokens a step), or "
             "write train.layout out")
    memory, intra, inter = train.cluster.figures()
    acc = ACCELERATORS[train.cluster.accelerator]
    params = param_count(model, vocab_size)
    lay = _planned(
        params=params, n_layers=model.n_layers, n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads, d_model=model.d_model, nodes=train.nodes,
        accelerators_per_node=train.procs_per_node, accelerator_memory_gb=memory,
        intra_node_gbps=intra, inter_node_gbps=inter, seq_len=model.seq_len,
        global_batch_tokens=batch,
        accelerator_tflops=train.peak_tflops or acc.peak_tflops, mfu=acc.mfu,
        trains=trains_today(train, sweep))
    state = state_bytes_per_param(lay.zero_stage, lay.dp) * params / (lay.tp * lay.pp) / GB
    _require(state <= STATE_SHARE * memory, "train.layout",
             f'"auto" finds no layout the trainer runs whose model states fit half of '
             f"{memory:g} GB per accelerator ({state:.1f} GB at best): "
             + "; ".join(lay.reasons),
             "give train.cluster the accelerators' real memory_gb, use more nodes, or a "
             "smaller model")
    act = activation_gb(model.n_layers, model.d_model, train.micro_batch_tokens, lay.tp,
                        recompute=model.activation_checkpointing)
    _require(state + act <= memory, "train.micro_batch_tokens",
             f"{train.micro_batch_tokens} tokens' activations ({act:.1f} GB) do not fit "
             f"beside the planned layout's {state:.1f} GB of states in {memory:g} GB",
             "lower micro_batch_tokens (raise grad_accum to keep the batch), or set "
             "model.activation_checkpointing")
    why = tuple(r for r in lay.reasons if not r.startswith("micro-batch"))
    return LayoutConfig(tp=lay.tp, pp=lay.pp, zero=lay.zero_stage,
                        why=(f"planned for {train.nodes} x {train.procs_per_node} "
                             f"{acc.name} ({params:,} parameters)", *why))


def _planned(**inputs: Any) -> Layout:
    """`plan_layout` for a run's "auto": its refusal names `train.layout`."""
    try:
        return plan_layout(**inputs)
    except BadConfig as exc:
        raise BadConfig("train.layout", f'"auto": {exc.problem}', exc.fix) from None


def _listing(options: list[int], cap: int) -> str:
    within = [d for d in options if d <= cap] or [1]
    return ", ".join(map(str, within))
