"""`mainspring plan`: how long a run will take, what it costs, how far it scales, and when it
beats buying the capability as an API — from published or measured figures, each named.

The arithmetic is small pure functions, checked in tests/ops/test_plan.py against
hand-worked numbers and against published runs. The figures it starts from (peaks, MFUs,
bandwidths, failure rates) live in ops/plan_facts.py with their sources; the command line
(flags, errors, text and JSON) in ops/plan_cli.py.

Compute is PaLM's (Chowdhery et al. 2022, appendix B): 6N per token plus 12·L·d·T for
attention. It mirrors trainer/throughput.py's flops_per_token rather than importing it,
because that module imports torch, and the planner runs where torch is not installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import BadConfig
from ops import plan_facts as facts
from spec.layout import plan_layout

LAYOUTS = ("auto", "dp", "zero1", "zero2", "zero3")
ZERO_LAYOUTS = {0: "dp", 1: "zero1", 2: "zero2", 3: "zero3"}  # plan_layout's stage, named


def flops_per_token(n_params: float, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N + 12·L·d·T (PaLM appendix B; trainer/throughput.py)."""
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len


def chinchilla_tokens(n_params: float) -> float:
    """Compute-optimal tokens: 20 per parameter (Hoffmann et al. 2022)."""
    return facts.CHINCHILLA_TOKENS_PER_PARAM * n_params


def shape_from_params(n_params: float, aspect: int = facts.ASPECT) -> tuple[int, int]:
    """(layers, d_model) for N = 12·L·d² with d = aspect·L, when they are not given."""
    layers = max(1, round((n_params / (12 * aspect ** 2)) ** (1 / 3)))
    return layers, max(1, round(math.sqrt(n_params / (12 * layers))))


def ring_allreduce_bytes(message_bytes: float, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce: 2·(G−1)/G of the message."""
    return 2.0 * (ranks - 1) / ranks * message_bytes if ranks > 1 else 0.0


def grad_sync_bytes(layout: str, shard_params: float, dp: int,
                    wire_bytes: int = facts.WIRE_BYTES) -> float:
    """Per-step data-parallel bytes per rank. DP, ZeRO-1 and ZeRO-2 all-reduce the gradients
    (ZeRO-1/2 as a reduce-scatter plus an all-gather of the same volume); ZeRO-3 also
    all-gathers the parameters again for the backward pass: 1.5x (ZeRO, arXiv 1910.02054,
    section 7)."""
    base = ring_allreduce_bytes(shard_params * wire_bytes, dp)
    return 1.5 * base if layout == "zero3" else base


def tp_bytes(layers_per_stage: float, tokens: float, d_model: int, tp: int,
             wire_bytes: int = facts.WIRE_BYTES) -> float:
    """Per-step tensor-parallel bytes per rank: per layer two all-reduces of the activations
    forward and two backward (Megatron-LM, arXiv 1909.08053, section 3), each tokens·d."""
    return layers_per_stage * 4 * ring_allreduce_bytes(tokens * d_model * wire_bytes, tp)


def pp_bytes(tokens: float, d_model: int, pp: int, wire_bytes: int = facts.WIRE_BYTES) -> float:
    """Per-step pipeline bytes per rank: the activations out and their gradients back."""
    return 2.0 * tokens * d_model * wire_bytes if pp > 1 else 0.0


def cpu_share(ranks: int, cores: int, threads: int = 1, background: float = 0.0) -> float:
    """The share of a core each rank's compute thread gets when `ranks` processes of
    `threads` threads run on `cores` cores beside `background` other runnable scheduling
    entities: all of one while they fit, cores/(ranks·threads + background) beyond, because
    the kernel's CFS time-slices runnable entities by weight, equal at equal nice, and a
    step's compute stretches by the oversubscription. With autogroup (Linux's default where
    it is built in) each session is one entity, whatever its thread count: torchrun starts
    every rank in a session of its own. An accelerator's ranks own their device: share 1."""
    return min(1.0, cores / (ranks * threads + background))


def dp_speedup(core_step_s: float, grad_bytes: float, ranks: int, link_bytes_per_s: float,
               cores: int, threads: int = 1, background: float = 0.0,
               base_background: float = 0.0) -> dict[str, float]:
    """Data parallelism with the same micro-batch per rank (the global batch grows with G).
    `core_step_s` is one step's compute on a core of its own (a rank's CPU seconds per
    step); it stretches by `cpu_share` at G ranks beside `background` other threads, and at
    one rank beside `base_background`. Communication: the ring all-reduce of the gradients
    at the link's bytes per second per rank, none of it hidden (DeepSpeed's ZeRO-0 engine
    reduces after the backward pass). Speed-up: G ranks' tokens per step time against one
    rank's."""
    one_s = core_step_s / cpu_share(1, cores, threads, base_background)
    compute_s = core_step_s / cpu_share(ranks, cores, threads, background)
    comm_s = ring_allreduce_bytes(grad_bytes, ranks) / link_bytes_per_s if ranks > 1 else 0.0
    total = compute_s + comm_s
    return {"one_rank_s": one_s, "compute_s": compute_s, "comm_s": comm_s, "step_s": total,
            "speedup": ranks * one_s / total}


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): the checkpoint interval √(2·T_s·T_f)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def available_interval(checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """The availability-optimal interval T_s + √(2(T_f+T_r)T_s + T_s²) (arXiv 2410.18124),
    which grows with the restart cost Young's form leaves out."""
    return checkpoint_s + math.sqrt(2.0 * (mtbf_s + restart_s) * checkpoint_s + checkpoint_s ** 2)


def badput(interval_s: float, checkpoint_s: float, mtbf_s: float,
           restart_s: float) -> dict[str, float]:
    """Fractions of wall time lost, to first order: checkpoint saves (T_s/T_c), and per
    failure half an interval of lost work plus the restart ((T_c/2 + T_r)/T_f)."""
    return {"checkpoint": checkpoint_s / interval_s,
            "lost_work": interval_s / 2.0 / mtbf_s,
            "restart": restart_s / mtbf_s}


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What `mainspring plan` is asked; None means the default of ops/plan_facts.py."""

    params: float  # parameters N
    tokens: float  # training tokens D
    accelerators: int  # G
    accelerator: str  # a key of plan_facts.ACCELERATORS
    hour_price: float  # USD per accelerator-hour, the low end
    hour_price_high: float | None = None  # the high end (default: hour_price)
    mtbf_hours: float | None = None  # per accelerator
    checkpoint_s: float | None = None
    restart_s: float | None = None
    mfu: float | None = None
    mfu_at: int | None = None  # accelerators the MFU was measured on (default: G)
    # a measured MFU's range and where it was measured (--mfu-from-run): printed with the
    # defaults; without them a given --mfu is its own range and needs no source
    mfu_low: float | None = None
    mfu_high: float | None = None
    mfu_source: str | None = None
    mfu_from: str = "--mfu-from-run"  # the flag that measured it
    peak_tflops: float | None = None
    layout: str = "auto"
    tp: int = 1
    pp: int = 1
    per_node: int | None = None
    cores: int | None = None  # a CPU host's cores (accelerator "cpu"): ranks beyond share them
    layers: int | None = None
    d_model: int | None = None
    seq_len: int | None = None
    batch_tokens: float | None = None
    overlap: float | None = None
    goodput: float | None = None  # overrides the failure model (a published figure)
    api_price_in: float | None = None  # USD per million tokens
    api_price_out: float | None = None
    api_tokens_per_month: float | None = None
    api_output_share: float | None = None

    def __post_init__(self) -> None:
        if self.accelerator not in facts.ACCELERATORS:
            raise BadConfig("--accelerator", f"unknown accelerator {self.accelerator!r}",
                            f"use one of {', '.join(facts.ACCELERATORS)}")
        if self.layout not in LAYOUTS:
            raise BadConfig("--layout", f"unknown layout {self.layout!r}",
                            f"use one of {', '.join(LAYOUTS)}")
        positive = {"--params": self.params, "--tokens": self.tokens,
                    "--accelerators": self.accelerators, "--hour-price": self.hour_price,
                    "--hour-price (high)": self.hour_price_high, "--mtbf-hours": self.mtbf_hours,
                    "--restart-s": self.restart_s, "--checkpoint-s": self.checkpoint_s,
                    "--mfu-at": self.mfu_at, "--peak-tflops": self.peak_tflops,
                    "--tp": self.tp, "--pp": self.pp, "--nodes-of": self.per_node,
                    "--cores": self.cores,
                    "--layers": self.layers, "--d-model": self.d_model,
                    "--seq-len": self.seq_len, "--batch-tokens": self.batch_tokens,
                    "--api-price-in": self.api_price_in, "--api-price-out": self.api_price_out,
                    "--api-tokens-per-month": self.api_tokens_per_month}
        for flag, value in positive.items():
            if value is not None and not (math.isfinite(value) and value > 0):
                raise BadConfig(flag, f"{value!r} is not a positive number",
                                "give a finite number above 0")
        fractions = {"--mfu": self.mfu, "--goodput": self.goodput, "--overlap": self.overlap,
                     "--api-output-share": self.api_output_share,
                     "--mfu (low)": self.mfu_low, "--mfu (high)": self.mfu_high}
        for flag, value in fractions.items():
            floor_ok = value is not None and (value > 0 or value == 0 and flag in (
                "--overlap", "--api-output-share"))
            if value is not None and not (floor_ok and value <= 1):
                raise BadConfig(flag, f"{value!r} is not a fraction", "give a number in (0, 1]")
        for flag, value in (*positive.items(), *fractions.items()):
            bound = facts.BOUNDS.get(flag)
            if value is not None and bound and (problem := facts.bound_problem(flag, value)):
                raise BadConfig(flag, problem, f"give {flag} in {facts.bound_text(bound)}")
        if (self.mfu_low is not None or self.mfu_high is not None) and not (
                self.mfu is not None and (self.mfu_low or self.mfu) <= self.mfu
                <= (self.mfu_high or self.mfu)):
            raise BadConfig("--mfu", "an MFU range that does not hold the MFU",
                            "give low <= mfu <= high")
        if self.hour_price_high is not None and self.hour_price_high < self.hour_price:
            raise BadConfig("--hour-price", "the high price is below the low one",
                            "write the range LOW..HIGH, e.g. 2..3.5")
        if self.accelerators % (self.tp * self.pp):
            raise BadConfig("--tp/--pp", f"{self.accelerators} accelerators do not split into "
                            f"TP {self.tp} x PP {self.pp} groups",
                            "give --accelerators a multiple of tp x pp")
        api = (self.api_price_in, self.api_price_out, self.api_tokens_per_month)
        if self.cores is not None and self.accelerator != "cpu":
            raise BadConfig("--cores", f"is a CPU host's, not a {self.accelerator}'s",
                            "drop --cores: an accelerator's ranks own their devices")
        if any(v is not None for v in api) and self.api_tokens_per_month is None:
            raise BadConfig("--api-tokens-per-month", "an API price without a monthly volume",
                            "give the tokens the API would serve a month, e.g. 5e9")


@dataclass(frozen=True, kw_only=True)
class Layout:
    name: str
    tp: int
    pp: int
    dp: int
    why: str


def choose_layout(inputs: PlanInputs, acc: facts.Accelerator, per_node: int, layers: int,
                  d_model: int, seq_len: int, batch_tokens: float, peak: float,
                  mfu: float) -> Layout:
    """The layout asked for; `auto`: the run spec's planner (spec/layout.py `plan_layout`,
    the one `train.layout: "auto"` runs), on G accelerators in nodes of `per_node`, with
    this accelerator's memory and links. Its heads are an assumption the plan's shape
    already makes: 128 dimensions each (Llama 3), as many kv heads (TP may split them)."""
    g, tp, pp = inputs.accelerators, inputs.tp, inputs.pp
    if inputs.layout != "auto":
        return Layout(name=inputs.layout, tp=tp, pp=pp, dp=g // (tp * pp), why="--layout")
    node = math.gcd(per_node, g)  # whole nodes of G (G below a node: one node of G)
    heads = max(1, d_model // facts.HEAD_DIM)
    try:
        lay = plan_layout(params=inputs.params, n_layers=layers, n_heads=heads,
                          n_kv_heads=heads, d_model=d_model, nodes=g // node,
                          accelerators_per_node=node, accelerator_memory_gb=acc.memory_gb,
                          intra_node_gbps=acc.intra_gbs, inter_node_gbps=acc.inter_gbs,
                          seq_len=seq_len, global_batch_tokens=int(batch_tokens),
                          accelerator_tflops=peak / 1e12, mfu=mfu)
    except BadConfig as exc:  # the planner names its own inputs; the user gave flags
        raise BadConfig("--batch-tokens", f"--layout auto: {exc.problem}",
                        "give --batch-tokens of at least --seq-len x --accelerators, fewer "
                        "--accelerators, or a --layout with --tp and --pp") from None
    return Layout(name=ZERO_LAYOUTS[lay.zero_stage], tp=lay.tp, pp=lay.pp, dp=lay.dp,
                  why="auto: " + "; ".join(lay.reasons))


def comm_seconds(lay: Layout, inputs: PlanInputs, acc: facts.Accelerator, per_node: int,
                 layers: int, d_model: int, batch_tokens: float, overlap: float,
                 accelerators: int) -> dict[str, float]:
    """Per-step communication of a layout on `accelerators`: seconds by kind and exposed."""
    dp = accelerators // (lay.tp * lay.pp)
    if dp < 1:  # fewer accelerators than one model replica: the measurement ran it whole
        return {"dp_s": 0.0, "tp_s": 0.0, "pp_s": 0.0, "exposed_s": 0.0}
    intra, inter = acc.intra_gbs * 1e9, acc.inter_gbs * 1e9
    tokens = batch_tokens / dp
    dp_link = inter if accelerators > per_node else intra
    pp_link = inter if lay.tp * lay.pp > per_node else intra
    tp_link = inter if lay.tp > per_node else intra
    dp_s = grad_sync_bytes(lay.name, inputs.params / (lay.tp * lay.pp), dp) / dp_link
    tp_s = tp_bytes(layers / lay.pp, tokens, d_model, lay.tp) / tp_link
    pp_s = pp_bytes(tokens, d_model, lay.pp) / pp_link
    # gradient traffic overlaps the backward pass; TP all-reduces and pipeline sends sit on
    # the critical path (Megatron-LM's layers wait for them)
    return {"dp_s": dp_s, "tp_s": tp_s, "pp_s": pp_s,
            "exposed_s": (1.0 - overlap) * dp_s + tp_s + pp_s}


def bubble_fraction(pp: int, micro_batches: float) -> float:
    """Pure: 1F1B's idle share of a pipeline's step, (p - 1) / (m + p - 1) for p stages and
    m micro-batches (Narayanan et al. 2021, arXiv 2104.04473, §2.2.1); 0 without one."""
    return (pp - 1) / (micro_batches + pp - 1) if pp > 1 else 0.0


def pipeline_micro_batches(batch_tokens: float, seq_len: int, dp: int) -> float:
    """A pipeline's micro-batches a step: its share of the batch in micro-batches of one
    sequence (Megatron-LM's at scale), at least one."""
    return max(1.0, batch_tokens / (max(dp, 1) * seq_len))


def device_mfu(mfu: float, step_flops: float, peak: float, mfu_at: int,
               exposed_at: float, bubble_at: float = 0.0, share_at: float = 1.0) -> float:
    """The compute-only MFU behind an end-to-end MFU measured on `mfu_at` accelerators:
    that step took step_flops/(G₀·peak·mfu), of which `exposed_at` was communication, a
    `bubble_at` share of the rest its pipeline's stages idle, and the compute ran on a
    `share_at` of a core (a CPU host's ranks sharing its cores)."""
    step_s = step_flops / (mfu_at * peak * mfu)
    compute_s = (step_s - exposed_at) * (1.0 - bubble_at) * share_at
    return min(1.0, step_flops / (mfu_at * peak * compute_s)) if compute_s > 0 else 1.0


def host_share(accelerators: int, per_node: int, cores: int | None) -> float:
    """Pure: the share of a core each rank of a CPU host gets (`cpu_share`) when a node runs
    min(G, per_node) single-threaded ranks on `cores` cores; 1 for accelerators, which own
    their devices (`cores` None)."""
    return cpu_share(min(accelerators, per_node), cores) if cores else 1.0


def scaling(inputs: PlanInputs, acc: facts.Accelerator, lay: Layout, per_node: int,
            layers: int, d_model: int, fpt: float, batch_tokens: float, overlap: float,
            peak: float, mfu: float, mfu_at: int, seq_len: int = facts.SEQ_LEN
            ) -> dict[str, float]:
    """Step time at G from the compute-only MFU, the pipeline's bubble, the cores a CPU
    host's ranks share and the exposed communication; the speed-up from one accelerator (no
    communication, no pipeline, a core of its own) to G and its ratio to linear. An MFU
    measured at the layout (G₀ holds a whole pipeline) already paid that layout's bubble,
    and one measured on G₀ ranks of a host their share of its cores: both are taken out
    before G's are put back."""
    step_flops = fpt * batch_tokens
    args = (lay, inputs, acc, per_node, layers, d_model, batch_tokens, overlap)
    g = inputs.accelerators

    def bubble(accelerators: int) -> float:
        whole = accelerators >= lay.tp * lay.pp  # else the measurement ran the model whole
        dp = accelerators // (lay.tp * lay.pp)
        return bubble_fraction(lay.pp, pipeline_micro_batches(batch_tokens, seq_len, dp)) \
            if whole else 0.0

    at = comm_seconds(*args, accelerators=mfu_at)
    dev_mfu = device_mfu(mfu, step_flops, peak, mfu_at, at["exposed_s"], bubble(mfu_at),
                         host_share(mfu_at, per_node, inputs.cores))
    comm = comm_seconds(*args, accelerators=g)
    idle, share = bubble(g), host_share(g, per_node, inputs.cores)
    compute_s = step_flops / (g * peak * dev_mfu) / (1.0 - idle) / share
    step_s = compute_s + comm["exposed_s"]
    one_s = step_flops / (peak * dev_mfu)
    return {"device_mfu": dev_mfu, "compute_s": compute_s, "bubble_fraction": idle,
            "core_share": share,
            **comm, "step_s": step_s, "mfu": step_flops / (g * peak * step_s),
            "speedup": one_s / step_s, "linear_ratio": one_s / step_s / g}


def goodput_model(inputs: PlanInputs, mtbf_hours: float, checkpoint_s: float,
                  restart_s: float) -> dict[str, float]:
    """The job's MTBF (per-accelerator MTBF / G), both checkpoint intervals, the badput at
    the availability-optimal one and the goodput left (or the one given, --goodput)."""
    mtbf_s = mtbf_hours * 3600.0 / inputs.accelerators
    interval = available_interval(checkpoint_s, mtbf_s, restart_s)
    lost = badput(interval, checkpoint_s, mtbf_s, restart_s)
    modeled = 1.0 - sum(lost.values())
    if inputs.goodput is None and modeled <= 0:
        raise BadConfig("--mtbf-hours", f"failures every {mtbf_s:.0f} s leave no progress "
                        f"with {checkpoint_s:g} s saves and {restart_s:g} s restarts",
                        "use fewer accelerators, faster checkpoints or restarts")
    return {"job_mtbf_s": mtbf_s, "young_interval_s": young_interval(checkpoint_s, mtbf_s),
            "interval_s": interval, "badput": lost, "modeled_goodput": modeled,
            "goodput": inputs.goodput if inputs.goodput is not None else modeled}


def plan(inputs: PlanInputs) -> dict:
    """The whole plan: figures, ranges and every default used with its source."""
    acc = facts.ACCELERATORS[inputs.accelerator]
    defaults: list[dict] = []

    def pick(flag: str, given, default, source: str):
        if given is not None:
            return given
        defaults.append({"input": flag, "value": default, "source": source})
        return default

    per_node = pick("--nodes-of", inputs.per_node, acc.per_node, f"{acc.name} nodes")
    peak = pick("--peak-tflops", inputs.peak_tflops, acc.peak_tflops, acc.peak_source) * 1e12
    mfu = pick("--mfu", inputs.mfu, acc.mfu, acc.mfu_source)
    if inputs.mfu_source:  # measured, not a default, but it prints with its source like one
        defaults.append({"input": inputs.mfu_from, "value": mfu, "source": inputs.mfu_source})
    # An MFU measured on one accelerator is compute only: the layout's communication at G is
    # added to it. One published at scale is end to end already (a different model's, at a
    # different G): it is taken as the planned run's, as is --mfu unless --mfu-at says where.
    measured_alone = inputs.mfu is None and acc.mfu_at == 1
    mfu_at = inputs.mfu_at or (1 if measured_alone else inputs.accelerators)
    lo, hi = ((acc.mfu_low, acc.mfu_high) if inputs.mfu is None
              else (inputs.mfu_low or mfu, inputs.mfu_high or mfu))
    if inputs.layers is None or inputs.d_model is None:
        est = shape_from_params(inputs.params)
        layers = pick("--layers", inputs.layers, est[0], facts.ASPECT_SOURCE)
        d_model = pick("--d-model", inputs.d_model, est[1], facts.ASPECT_SOURCE)
    else:
        layers, d_model = inputs.layers, inputs.d_model
    seq = pick("--seq-len", inputs.seq_len, facts.SEQ_LEN, facts.SEQ_SOURCE)
    batch = pick("--batch-tokens", inputs.batch_tokens, facts.BATCH_TOKENS, facts.BATCH_SOURCE)
    overlap = pick("--overlap", inputs.overlap, facts.OVERLAP, facts.OVERLAP_SOURCE)
    mtbf = pick("--mtbf-hours", inputs.mtbf_hours, facts.MTBF_HOURS_PER_ACCELERATOR,
                facts.MTBF_SOURCE)
    ckpt = pick("--checkpoint-s", inputs.checkpoint_s, facts.CHECKPOINT_S,
                facts.CHECKPOINT_SOURCE)
    restart = pick("--restart-s", inputs.restart_s, facts.RESTART_S, facts.RESTART_SOURCE)
    for flag, value, source in (("intra-node bandwidth (GB/s)", acc.intra_gbs, acc.intra_source),
                                ("inter-node bandwidth (GB/s)", acc.inter_gbs, acc.inter_source)):
        defaults.append({"input": flag, "value": value, "source": source})

    fpt = flops_per_token(inputs.params, layers, d_model, seq)
    lay = choose_layout(inputs, acc, per_node, layers, d_model, seq, batch, peak, mfu)
    scale_args = (inputs, acc, lay, per_node, layers, d_model, fpt, batch, overlap, peak)
    mid, slow, fast = (scaling(*scale_args, m, mfu_at, seq) for m in (mfu, lo, hi))
    good = goodput_model(inputs, mtbf, ckpt, restart)
    total = fpt * inputs.tokens

    def hours(s: dict) -> float:
        return total / (inputs.accelerators * peak * s["mfu"]) / good["goodput"] / 3600.0

    price_hi = inputs.hour_price_high or inputs.hour_price
    acc_h = {"expected": hours(mid) * inputs.accelerators,
             "low": hours(fast) * inputs.accelerators, "high": hours(slow) * inputs.accelerators}
    cost = {"expected": acc_h["expected"] * (inputs.hour_price + price_hi) / 2,
            "low": acc_h["low"] * inputs.hour_price, "high": acc_h["high"] * price_hi}
    wall_h = hours(mid)
    out = {"inputs": {"params": inputs.params, "tokens": inputs.tokens,
                      "accelerators": inputs.accelerators, "accelerator": acc.name,
                      "hour_price": [inputs.hour_price, price_hi]},
           "compute": {"flops_per_token": fpt, "total_flops": total, "layers": layers,
                       "d_model": d_model, "seq_len": seq, "peak_tflops": peak / 1e12,
                       "mfu": mfu, "mfu_range": [lo, hi], "mfu_at": mfu_at},
           "layout": {"name": lay.name, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
                      "why": lay.why},
           "scaling": mid, "goodput": good,
           "wall_hours": {"expected": wall_h, "low": hours(fast), "high": hours(slow)},
           "accelerator_hours": acc_h, "cost_usd": cost,
           "failures_expected": wall_h * 3600.0 / good["job_mtbf_s"]}
    out["build_vs_buy"] = build_vs_buy(inputs, cost, defaults)
    out["defaults"] = defaults
    return out


def build_vs_buy(inputs: PlanInputs, cost: dict[str, float], defaults: list[dict]) -> dict | None:
    """The months of API use whose bill equals the training cost (None: no API figures)."""
    if inputs.api_tokens_per_month is None:
        return None
    share = inputs.api_output_share
    if share is None:
        share = facts.API_OUTPUT_SHARE
        defaults.append({"input": "--api-output-share", "value": share,
                         "source": facts.API_OUTPUT_SOURCE})
    per_million = (1 - share) * (inputs.api_price_in or 0.0) + share * (inputs.api_price_out or 0.0)
    monthly = inputs.api_tokens_per_month / 1e6 * per_million
    if monthly <= 0:
        raise BadConfig("--api-price-in/--api-price-out", "the API bill is zero",
                        "give the API's USD price per million input and output tokens")
    return {"monthly_bill_usd": monthly,
            "break_even_months": {k: v / monthly for k, v in cost.items()}}
