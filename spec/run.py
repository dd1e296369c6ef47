"""RunSpec: the one root config of a run (DESIGN §9). Stdlib only — the workflow imports it.

Every section is a frozen, kw-only dataclass that validates itself in `__post_init__`
and raises `BadConfig` naming the dotted field and the fix. `RunSpec.from_dict` is the
only way JSON/TOML becomes a spec (spec/codec.py): it rejects unknown fields, wrong
types, non-finite numbers and values outside each field's documented range `num(default,
lo, hi)` by name. Cross-field rules, storage URLs (common/urls.py) and every trial the sweep
can run are checked here too, so nothing the workflow derives from a valid spec can fail.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from common import urls
from common.errors import BadConfig
from spec.codec import STEPS, build, deep_merge, dotted_to_nested, num
from spec.codec import positive as _positive
from spec.codec import require as _require
from spec.data import CleaningConfig, DataConfig, DedupConfig, TokenizerConfig

__all__ = ["CleaningConfig", "DataConfig", "DedupConfig", "FaultSpec", "ModelConfig", "OpsConfig",
           "RunSpec", "SearchDim", "SpikeBudget", "SpikeConfig", "StorageConfig", "SweepConfig",
           "TokenizerConfig", "TrainConfig", "PRESETS", "deep_merge", "dotted_to_nested", "preset"]

RUN_ID_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # fullmatch: "demo\n" is not a run id
DAY = 86400.0
MAX_FAULTS = 64
SWEPT = ("lr", "weight_decay", "warmup_steps")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Llama-style decoder; vocab size comes from the dataset's tokenizer."""

    d_model: int = num(128, 1, 1 << 16)
    n_layers: int = num(4, 1, 1024)
    n_heads: int = num(4, 1, 1024)
    n_kv_heads: int = num(4, 1, 1024)
    ffn_mult: float = num(4.0, 0, 64)  # SwiGLU hidden = ffn_mult * d_model * 2/3, rounded up to 64
    seq_len: int = num(128, 1, 1 << 20)
    tie_embeddings: bool = True
    attention: str = "auto"  # auto | flash | sdpa
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        _positive(self, "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_mult", "seq_len")
        _require(self.d_model % self.n_heads == 0, "d_model",
                 f"{self.d_model} is not divisible by n_heads={self.n_heads}",
                 "choose d_model as a multiple of n_heads")
        _require(self.n_heads % self.n_kv_heads == 0, "n_kv_heads",
                 f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}",
                 "choose n_kv_heads dividing n_heads")
        _require((self.d_model // self.n_heads) % 2 == 0, "d_model",
                 "head dimension must be even for RoPE", "make d_model / n_heads even")
        _require(self.attention in ("auto", "flash", "sdpa"), "attention",
                 f"unknown attention {self.attention!r}", "use auto, flash or sdpa")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    total_steps: int = num(200, 1, STEPS)
    segment_steps: int = num(100, 1, STEPS)  # steps per train_segment activity
    # continue-as-new after this many segments (history bound)
    segments_per_run: int = num(4, 1, 1000)
    # tokens per rank per micro-batch (multiple of seq_len)
    micro_batch_tokens: int = num(1024, 1, 1 << 30)
    grad_accum: int = num(1, 1, 1 << 16)
    lr: float = num(3e-3, 0, 10)
    min_lr: float = num(3e-4, 0, 10)
    warmup_steps: int = num(20, 0, STEPS)
    weight_decay: float = num(0.1, 0, 10)
    betas: tuple[float, float] = num((0.9, 0.95), 0, 1)
    eps: float = num(1e-8, 0, 1)
    grad_clip: float = num(1.0, 0, 1e6)
    precision: str = "fp32"  # fp32 | bf16 | fp16
    zero_stage: int = num(0, 0, 3)
    nodes: int = num(1, 1, 10**4)
    procs_per_node: int = num(1, 1, 1024)
    checkpoint_every: int = num(25, 1, STEPS)
    eval_batches: int = num(8, 1, 10**6)  # validation micro-batches per evaluation
    packing: bool = True  # pack whole documents into rows (False: fixed windows of the stream)
    # fp16 dynamic loss scaling (DeepSpeed): start at 2**power, double after `window`
    # overflow-free steps, halve after `hysteresis` overflows, never below `min_loss_scale`.
    fp16_initial_scale_power: int = num(16, 0, 32)
    fp16_loss_scale_window: int = num(1000, 1, 10**9)
    fp16_hysteresis: int = num(2, 1, 10**6)
    fp16_min_loss_scale: float = num(1.0, 0, 2.0**32)
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

    def __post_init__(self) -> None:
        _positive(self, "total_steps", "segment_steps", "segments_per_run", "micro_batch_tokens",
                  "grad_accum", "lr", "checkpoint_every", "nodes", "procs_per_node",
                  "eval_batches", "eps", "fp16_loss_scale_window", "fp16_hysteresis",
                  "fp16_min_loss_scale", "reduce_bucket_size", "allgather_bucket_size")
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

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass(frozen=True, kw_only=True)
class SearchDim:
    low: float = num(lo=0, hi=STEPS)
    high: float = num(lo=0, hi=STEPS)
    log: bool = True

    def __post_init__(self) -> None:
        _require(self.low < self.high, "low", "must be below high", "swap low and high")
        # >= 1e-12: high / low stays finite, and so does every point the suggester picks
        _require(not self.log or self.low >= 1e-12, "low", "log scale needs low >= 1e-12",
                 "use a positive low or log=false")


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """Warm-up sweep: short trials over `space`, best held-out loss wins."""

    enabled: bool = True
    space: dict[str, SearchDim] = field(
        default_factory=lambda: {"lr": SearchDim(low=1e-3, high=1e-2, log=True)})
    trials: int = num(2, 1, 1000)  # trial run ids end in -trial-<index>: 3 digits at most
    parallel: int = num(1, 1, 256)
    trial_steps: int = num(30, 1, STEPS)

    def __post_init__(self) -> None:
        _positive(self, "trials", "parallel", "trial_steps")
        _require(set(self.space) <= set(SWEPT), "space",
                 f"unknown parameter(s) {sorted(set(self.space) - set(SWEPT))}",
                 "sweep lr, weight_decay or warmup_steps")
        _require(not self.enabled or self.trials >= 2, "trials", "a sweep needs >= 2 trials",
                 "raise trials or set enabled=false")


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    """Where checkpoints and events live, what is kept, and how saves reach the durable tier.

    The trainer writes each checkpoint to the fast tier (local disk under `fast`) inside
    the step loop and uploads it to `durable` in the background (`async_upload`); only the
    durable commit counts as committed (DESIGN §3).
    """

    durable: str = ".mainspring/store"  # fsspec URL (file://, s3://, memory://) or a local path
    fast: str = ".mainspring/fast"  # local path of the fast tier
    keep_last: int = num(0, 0, 10**6)  # keep the newest K durable commits; 0 = keep every commit
    keep_every: int = num(0, 0, STEPS)  # with keep_last: also keep steps divisible by this
    # with keep_last: keep all commits this many steps behind newest
    rollback_horizon: int = num(0, 0, STEPS)
    async_upload: bool = True  # False = upload and commit inside the step loop (synchronous)
    max_in_flight: int = num(2, 1, 64)  # snapshots written to the fast tier but not yet durable
    upload_retry_s: float = num(1.0, 0, 3600)  # first backoff after a failed upload; doubles
    upload_retry_max_s: float = num(30.0, 0, DAY)  # backoff ceiling while the durable tier is down
    drain_timeout_s: float = num(900.0, 0, 7 * DAY)  # segment end: wait for uploads, then retryable

    def __post_init__(self) -> None:
        _require(bool(self.durable), "durable", "is empty", "give a path or s3://bucket/prefix")
        for name in ("keep_last", "keep_every", "rollback_horizon"):
            _require(getattr(self, name) >= 0, name, "must be >= 0", "use 0 to disable it")
        _require(self.max_in_flight >= 1, "max_in_flight", "must be >= 1",
                 "allow at least one snapshot in flight (2 overlaps a save with an upload)")
        _positive(self, "upload_retry_s", "upload_retry_max_s", "drain_timeout_s")
        _require(self.upload_retry_max_s >= self.upload_retry_s, "upload_retry_max_s",
                 "is below upload_retry_s", "make the ceiling at least the first backoff")


@dataclass(frozen=True, kw_only=True)
class SpikeBudget:
    rollbacks: int = num(3, 1, 10**6)  # rollbacks allowed per `per_steps` before escalating
    per_steps: int = num(1000, 1, STEPS)

    def __post_init__(self) -> None:
        _positive(self, "rollbacks", "per_steps")


@dataclass(frozen=True, kw_only=True)
class SpikeConfig:
    """Loss-spike handling (trainer/spikes.py); thresholds in robust standard deviations."""

    enabled: bool = True
    window: int = num(50, 1, 10**6)  # accepted losses in the robust baseline (median / MAD)
    warmup: int = num(20, 0, 10**6)  # losses observed before the detector judges
    skip_threshold: float = num(6.0, 0, 1e6)  # loss above median + k * spread is an outlier
    return_threshold: float = num(4.0, 0, 1e6)  # after an outlier, above this is not back yet
    min_spread: float = num(0.01, 0, 1e6)  # spread floor, relative to |median|, flat history
    patience: int = num(3, 1, 10**6)  # outliers within `window` steps that make a sustained spike
    skip_before: int = num(2, 0, STEPS)  # batches before the onset also skipped on rollback
    skip_window: int = num(16, 1, STEPS)  # batches skipped from there (PaLM: 200-500 at scale)
    lr_backoff: float = num(0.5, 0, 1)  # LR factor the workflow applies when the budget is spent
    lr_backoff_steps: int = num(500, 1, STEPS)  # for this many steps
    budget: SpikeBudget = field(default_factory=SpikeBudget)

    def __post_init__(self) -> None:
        _positive(self, "window", "skip_threshold", "min_spread", "patience", "skip_window",
                  "lr_backoff_steps")
        _require(self.warmup >= 0, "warmup", "must be >= 0", "use 0 to judge from the start")
        _require(self.skip_before >= 0, "skip_before", "must be >= 0",
                 "use 0 to skip from the onset")
        _require(self.patience <= self.window, "patience", "exceeds window",
                 "make patience <= window")
        _require(0 < self.return_threshold <= self.skip_threshold, "return_threshold",
                 f"must be in (0, skip_threshold={self.skip_threshold}], got "
                 f"{self.return_threshold}", "use e.g. 3.0")
        _require(0 < self.lr_backoff < 1, "lr_backoff", f"must be in (0, 1), got {self.lr_backoff}",
                 "use e.g. 0.5")


FAULT_KINDS = ("kill_worker", "corrupt_batches", "lr_burst", "nan_loss")


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """An injected fault (tests, benchmarks and the demo only; trainer/faults.py).

    - kill_worker: SIGKILL the trainer worker right after `at_step` (on `attempt` only);
    - corrupt_batches: the data batches that steps at_step .. at_step+steps-1 read in the
      original order hold random tokens — bad data, there on every attempt and replay;
    - lr_burst: the LR is multiplied by `factor` for `steps` steps from `at_step`, once;
    - nan_loss: the loss of step `at_step` is NaN (its gradients too), once.
    """

    kind: str
    at_step: int = num(lo=1, hi=STEPS)
    # kill_worker fires only on this activity attempt, so the retry recovers
    attempt: int = num(1, 1, 10**6)
    steps: int = num(1, 1, STEPS)
    factor: float = num(30.0, 0, 1e6)

    def __post_init__(self) -> None:
        _require(self.kind in FAULT_KINDS, "kind", f"unknown fault {self.kind!r}",
                 f"use one of {', '.join(FAULT_KINDS)}")
        _require(self.at_step > 0, "at_step", "must be > 0", "inject after step 0")
        _positive(self, "attempt", "steps", "factor")


@dataclass(frozen=True, kw_only=True)
class OpsConfig:
    # >= 1 s: Temporal reads a timeout that rounds to 0 as "none" and refuses the activity
    heartbeat_timeout_s: float = num(30.0, 1, DAY)
    hang_timeout_s: float = num(600.0, 0, 7 * DAY)  # no progress for this long = hung trainer
    # a cancelled segment (operator pause/rollback/abort) may take this long to commit a
    # checkpoint at its current step and upload it before the trainer is killed
    stop_grace_s: float = num(300.0, 0, DAY)
    segment_budget_s: float = num(7 * DAY, 1, 365 * DAY)  # schedule-to-close, all retries
    otlp_endpoint: str = ""
    metrics_port: int = num(0, 0, 65535)  # ignored: the port is per worker (`--metrics-port`)
    metrics_every: int = num(10, 1, 10**9)  # steps per durable train_metrics event (report)

    def __post_init__(self) -> None:
        _positive(self, "heartbeat_timeout_s", "hang_timeout_s", "segment_budget_s",
                  "stop_grace_s", "metrics_every")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    run_id: str
    seed: int = num(1234, 0, 2**63 - 1)  # fits a signed 64-bit integer everywhere it goes
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    spikes: SpikeConfig = field(default_factory=SpikeConfig)
    faults: tuple[FaultSpec, ...] = ()
    ops: OpsConfig = field(default_factory=OpsConfig)

    def __post_init__(self) -> None:
        _require(bool(RUN_ID_RE.fullmatch(self.run_id)), "run_id",
                 f"{self.run_id[:80]!r} is not a valid run id",
                 "use lowercase letters, digits and '-', starting with a letter or digit, "
                 "at most 63 characters")
        t, m = self.train, self.model
        _require(t.micro_batch_tokens % m.seq_len == 0, "train.micro_batch_tokens",
                 f"{t.micro_batch_tokens} is not a multiple of model.seq_len={m.seq_len}",
                 "make micro_batch_tokens a multiple of seq_len")
        _require(t.checkpoint_every <= t.segment_steps, "train.checkpoint_every",
                 "is longer than a segment", "make checkpoint_every <= segment_steps")
        _require(len(self.faults) <= MAX_FAULTS, "faults",
                 f"has {len(self.faults)} entries (at most {MAX_FAULTS})", "inject fewer faults")
        urls.check_durable(self.storage.durable, "storage.durable")
        urls.check_local_dir(self.storage.fast, "storage.fast")
        urls.check_input(self.data.corpus, "data.corpus", stdlib=True)
        if self.data.tokenizer.path:
            urls.check_input(self.data.tokenizer.path, "data.tokenizer.path")
        urls.check_endpoint(self.ops.otlp_endpoint, "ops.otlp_endpoint")
        lr_dim = self.sweep.space.get("lr")
        _require(not (self.sweep.enabled and lr_dim and lr_dim.low < t.min_lr),
                 "sweep.space.lr.low", f"is below train.min_lr={t.min_lr}",
                 "raise the sweep's lower bound or lower train.min_lr")
        self._check_sweep_ends()

    def _check_sweep_ends(self) -> None:
        """Every trial the sweep can run, and the run its best point trains, is a valid spec.

        Checked at both ends of each swept dimension: each rule on a swept value involves
        one swept parameter (lr vs min_lr, warmup_steps vs total_steps), so the ends bound
        every point in between. Mirrors workflows/policy.py `trial_spec` and `with_params`
        (tests/spec/test_spec.py holds them to it); the checked specs have the sweep off,
        so they do not check further.
        """
        if not self.sweep.enabled:
            return
        base = deep_merge(self.to_dict(), {"sweep": {"enabled": False}})
        steps = self.sweep.trial_steps
        for name, dim in sorted(self.sweep.space.items()):
            for end, value in sweep_ends(name, dim):
                trial = {"faults": [], "train": {
                    "total_steps": steps, "segment_steps": steps, "checkpoint_every": steps,
                    "warmup_steps": min(self.train.warmup_steps, steps // 5), name: value}}
                for what, over in (("a sweep trial", trial), ("training", {"train": {name: value}})):
                    try:
                        RunSpec.from_dict(deep_merge(base, over))
                    except BadConfig as exc:
                        raise BadConfig(
                            f"sweep.space.{name}.{end}",
                            f"{what} with train.{name}={value!r} is refused ({exc.field}: "
                            f"{exc.problem})",
                            f"narrow sweep.space.{name}" + (f"; {exc.fix}" if exc.fix else "")
                        ) from None

    # ---- (de)serialisation -------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Any) -> RunSpec:
        return build(cls, raw, "")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def spec_hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **sections: Any) -> RunSpec:
        """Override fields by dotted name: spec.replace(**{"train.lr": 1e-3})."""
        return RunSpec.from_dict(deep_merge(self.to_dict(), dotted_to_nested(sections)))


def sweep_ends(name: str, dim: SearchDim) -> tuple[tuple[str, float | int], ...]:
    """(end, value) at both ends of a swept dimension, computed the way the suggester
    (sweep/suggest.py `from_unit` at 0 and 1) and `trial_spec` (int) compute them."""
    high = dim.low * (dim.high / dim.low) ** 1.0 if dim.log else dim.low + (dim.high - dim.low)
    ends = (("low", dim.low), ("high", high))
    if name == "warmup_steps":
        return tuple((end, int(float(round(v)))) for end, v in ends)
    return ends


PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for 2 CPU cores in a few minutes; loss falls visibly.
    "demo": {
        "run_id": "demo",
        "data": {"corpus": "stdlib:*.py", "max_documents": 120,
                 "tokenizer": {"vocab_size": 1024}},
        "model": {"d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "seq_len": 128},
        "train": {"total_steps": 160, "segment_steps": 80, "segments_per_run": 1,
                  "micro_batch_tokens": 1024, "warmup_steps": 10, "checkpoint_every": 20,
                  "eval_every": 40},
        "sweep": {"trials": 2, "trial_steps": 15},
        # A lost node mid-segment, then a window of bad data (a loss spike -> rollback).
        "faults": [{"kind": "kill_worker", "at_step": 50},
                   {"kind": "corrupt_batches", "at_step": 110, "steps": 4}],
        "ops": {"heartbeat_timeout_s": 10.0},
    },
}


def preset(name: str, **overrides: Any) -> RunSpec:
    if name not in PRESETS:
        raise BadConfig("preset", f"unknown preset {name!r}", f"use one of {', '.join(PRESETS)}")
    return RunSpec.from_dict(deep_merge(PRESETS[name], dotted_to_nested(overrides)))
