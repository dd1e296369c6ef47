"""RunSpec: the one root config of a run (DESIGN §9). Stdlib only — the workflow imports it.

Every section is a frozen, kw-only dataclass that validates itself in `__post_init__`
and raises `BadConfig` naming the dotted field and the fix. `RunSpec.from_dict` is the
only way JSON/TOML becomes a spec: it rejects unknown fields and wrong types by name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ops.errors import BadConfig

RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def _require(ok: bool, name: str, problem: str, fix: str) -> None:
    if not ok:
        raise BadConfig(name, problem, fix)


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value > 0, name, f"must be > 0, got {value!r}", f"set {name} to a positive number")


@dataclass(frozen=True, kw_only=True)
class CleaningConfig:
    """Per-document filters applied before dedup (each counted in the dataset manifest).

    The repetition thresholds are Gopher's (Rae et al. 2021, "Scaling Language Models",
    Appendix A Table A1), also used by RefinedWeb (Penedo et al. 2023, §G.1). A fraction
    of 1.0 disables that filter.
    """

    normalize: str = "NFC"  # Unicode normal form applied to every document
    min_chars: int = 64  # documents shorter than this are dropped
    max_chars: int = 200_000  # documents longer than this are dropped
    max_dup_line_fraction: float = 0.30  # share of lines that repeat an earlier line
    max_dup_line_char_fraction: float = 0.20  # share of characters in such lines
    # Most frequent word n-gram's share of characters, for n = 2, 3, 4.
    max_top_ngram_char_fraction: tuple[float, float, float] = (0.20, 0.18, 0.16)
    # Share of characters in repeated word n-grams, for n = 5 .. 10.
    max_dup_ngram_char_fraction: tuple[float, float, float, float, float, float] = (
        0.15, 0.14, 0.13, 0.12, 0.11, 0.10)
    # Mostly-non-text documents: share of non-whitespace characters that are letters or
    # digits (0 disables). Source code sits around 0.7, binary dumps and tables far lower.
    min_alnum_fraction: float = 0.5

    def __post_init__(self) -> None:
        _require(self.normalize in ("NFC", "NFKC", "none"), "normalize",
                 f"unknown form {self.normalize!r}", "use NFC, NFKC or none")
        _positive(self, "min_chars", "max_chars")
        _require(self.max_chars >= self.min_chars, "max_chars", "is below min_chars",
                 "raise max_chars or lower min_chars")
        for name in ("max_dup_line_fraction", "max_dup_line_char_fraction",
                     "max_top_ngram_char_fraction", "max_dup_ngram_char_fraction",
                     "min_alnum_fraction"):
            values = getattr(self, name)
            for v in values if isinstance(values, tuple) else (values,):
                _require(0.0 <= v <= 1.0, name, f"must be a fraction in [0, 1], got {v}",
                         "use 1.0 to disable a max_* filter, 0.0 to disable min_alnum_fraction")


@dataclass(frozen=True, kw_only=True)
class DedupConfig:
    """Exact and MinHash-LSH near-duplicate removal; the first document of a cluster stays."""

    exact: bool = True  # drop documents whose normalised text hash was already seen
    near: bool = True  # drop documents whose word-shingle Jaccard to a kept one >= threshold
    threshold: float = 0.8  # Jaccard similarity of word n-gram sets counted as near-duplicate
    num_perm: int = 128  # MinHash permutations (signature length)
    ngram: int = 5  # words per shingle (5 as in RefinedWeb and BigCode near-dedup)

    def __post_init__(self) -> None:
        _require(0.0 < self.threshold <= 1.0, "threshold",
                 f"must be in (0, 1], got {self.threshold}", "use e.g. 0.8")
        _require(16 <= self.num_perm <= 1024, "num_perm",
                 f"must be in [16, 1024], got {self.num_perm}", "use e.g. 128")
        _require(1 <= self.ngram <= 32, "ngram", f"must be in [1, 32], got {self.ngram}",
                 "use e.g. 5")


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    vocab_size: int = 2048  # byte-level BPE trained on the cleaned corpus
    path: str = ""  # an existing tokenizer.json (fsspec URL) instead of training one

    def __post_init__(self) -> None:
        _require(257 <= self.vocab_size <= 1 << 20, "vocab_size",
                 f"must be in [257, 1048576], got {self.vocab_size}",
                 "byte-level BPE needs at least 256 byte tokens plus specials")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the corpus is and how it becomes token shards."""

    # fsspec URL or glob; `stdlib:<glob>` means this Python's standard library sources.
    corpus: str = "stdlib:*.py"
    format: str = "auto"  # auto (by extension) | txt | jsonl | parquet
    text_field: str = "text"  # the text key of .jsonl records and the text column of .parquet
    max_documents: int = 0  # 0 = all; otherwise the first N documents in path order
    cleaning: CleaningConfig = field(default_factory=CleaningConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shard_tokens: int = 1 << 20  # tokens per shard file
    val_fraction: float = 0.05  # share of documents (by hash) held out for validation
    workers: int = 0  # processes for read/clean/hash/tokenize; 0 = every core
    unit_bytes: int = 1 << 20  # input bytes per work unit (the unit of resume after a crash)

    def __post_init__(self) -> None:
        _require(bool(self.corpus.strip()), "corpus", "is empty",
                 "point it at a file, directory glob or fsspec URL of .txt/.jsonl/.parquet files")
        _require(self.format in ("auto", "txt", "jsonl", "parquet"), "format",
                 f"unknown format {self.format!r}", "use auto, txt, jsonl or parquet")
        _require(self.workers >= 0, "workers", "must be >= 0", "use 0 for every core")
        _positive(self, "unit_bytes")
        _require(self.max_documents >= 0, "max_documents", "must be >= 0", "use 0 for all")
        _positive(self, "shard_tokens")
        _require(0.0 < self.val_fraction < 0.5, "val_fraction",
                 f"must be in (0, 0.5), got {self.val_fraction}", "use e.g. 0.05")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Llama-style decoder; vocab size comes from the dataset's tokenizer."""

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_mult: float = 4.0  # SwiGLU hidden = ffn_mult * d_model * 2/3, rounded up to 64
    seq_len: int = 128
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
    total_steps: int = 200
    segment_steps: int = 100  # steps per train_segment activity
    segments_per_run: int = 4  # continue-as-new after this many segments (history bound)
    micro_batch_tokens: int = 1024  # tokens per rank per micro-batch (multiple of seq_len)
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    precision: str = "fp32"  # fp32 | bf16 | fp16
    zero_stage: int = 0
    nodes: int = 1
    procs_per_node: int = 1
    checkpoint_every: int = 25
    eval_batches: int = 8  # validation micro-batches per evaluation
    packing: bool = True  # pack whole documents into rows (False: fixed windows of the stream)
    # fp16 dynamic loss scaling (DeepSpeed): start at 2**power, double after `window`
    # overflow-free steps, halve after `hysteresis` overflows, never below `min_loss_scale`.
    fp16_initial_scale_power: int = 16
    fp16_loss_scale_window: int = 1000
    fp16_hysteresis: int = 2
    fp16_min_loss_scale: float = 1.0
    overlap_comm: bool = False  # overlap gradient reduction with backward (ZeRO >= 1)
    contiguous_gradients: bool = True  # copy gradients into one buffer (less fragmentation)
    reduce_bucket_size: int = 500_000_000  # elements per gradient reduce bucket
    allgather_bucket_size: int = 500_000_000  # elements per parameter all-gather bucket
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = measure with a matmul probe
    # Online evaluation inside the segment: held-out loss every `eval_every` steps (0 = off).
    # Validation rising while training loss falls for `overfit_evals` evaluations in a row
    # raises an `overfitting` event; `early_stop_on_overfit` also ends training there.
    eval_every: int = 0
    overfit_evals: int = 3
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
    low: float
    high: float
    log: bool = True

    def __post_init__(self) -> None:
        _require(self.low < self.high, "low", "must be below high", "swap low and high")
        _require(not self.log or self.low > 0, "low", "log scale needs low > 0",
                 "use a positive low or log=false")


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """Warm-up sweep: short trials over `space`, best held-out loss wins."""

    enabled: bool = True
    space: dict[str, SearchDim] = field(
        default_factory=lambda: {"lr": SearchDim(low=1e-3, high=1e-2, log=True)})
    trials: int = 2
    parallel: int = 1
    trial_steps: int = 30

    def __post_init__(self) -> None:
        _positive(self, "trials", "parallel", "trial_steps")
        _require(set(self.space) <= {"lr", "weight_decay", "warmup_steps"}, "space",
                 f"unknown parameter(s) {sorted(set(self.space) - {'lr', 'weight_decay', 'warmup_steps'})}",
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
    keep_last: int = 0  # keep the newest K durable commits; 0 = keep every commit
    keep_every: int = 0  # with keep_last: also keep every step divisible by this; 0 = none
    rollback_horizon: int = 0  # with keep_last: keep all commits this many steps behind newest
    async_upload: bool = True  # False = upload and commit inside the step loop (synchronous)
    max_in_flight: int = 2  # snapshots written to the fast tier but not yet durable
    upload_retry_s: float = 1.0  # first backoff after a failed upload; doubles each retry
    upload_retry_max_s: float = 30.0  # backoff ceiling while the durable tier is down
    drain_timeout_s: float = 900.0  # segment end: wait this long for uploads, then retryable

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
    rollbacks: int = 3  # rollbacks allowed per `per_steps` before the workflow escalates
    per_steps: int = 1000

    def __post_init__(self) -> None:
        _positive(self, "rollbacks", "per_steps")


@dataclass(frozen=True, kw_only=True)
class SpikeConfig:
    """Loss-spike handling (trainer/spikes.py); thresholds in robust standard deviations."""

    enabled: bool = True
    window: int = 50  # accepted losses in the robust baseline (median / MAD)
    warmup: int = 20  # losses observed before the detector judges
    skip_threshold: float = 6.0  # loss above median + k * spread is an outlier (spikes.py)
    return_threshold: float = 4.0  # after an outlier, losses above this many are not back yet
    min_spread: float = 0.01  # spread floor, relative to |median|, for a flat history
    patience: int = 3  # outliers within `window` steps that make a sustained spike
    skip_before: int = 2  # batches before the onset also skipped on rollback
    skip_window: int = 16  # batches skipped from there (PaLM: 200-500 at full scale)
    lr_backoff: float = 0.5  # LR factor the workflow applies when the budget is spent
    lr_backoff_steps: int = 500  # for this many steps
    budget: SpikeBudget = field(default_factory=SpikeBudget)

    def __post_init__(self) -> None:
        _positive(self, "window", "skip_threshold", "min_spread", "patience", "skip_window",
                  "lr_backoff_steps")
        _require(self.warmup >= 0 and self.skip_before >= 0, "warmup", "must be >= 0",
                 "use 0 to judge from the start")
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
    at_step: int
    attempt: int = 1  # kill_worker fires only on this activity attempt, so the retry recovers
    steps: int = 1
    factor: float = 30.0

    def __post_init__(self) -> None:
        _require(self.kind in FAULT_KINDS, "kind", f"unknown fault {self.kind!r}",
                 f"use one of {', '.join(FAULT_KINDS)}")
        _require(self.at_step > 0, "at_step", "must be > 0", "inject after step 0")
        _positive(self, "steps", "factor")


@dataclass(frozen=True, kw_only=True)
class OpsConfig:
    heartbeat_timeout_s: float = 30.0
    hang_timeout_s: float = 600.0  # no progress for this long = hung trainer
    # a cancelled segment (operator pause/rollback/abort) may take this long to commit a
    # checkpoint at its current step and upload it before the trainer is killed
    stop_grace_s: float = 300.0
    segment_budget_s: float = 7 * 24 * 3600.0  # schedule-to-close across all retries
    otlp_endpoint: str = ""
    metrics_port: int = 0  # ignored: the port is per worker (`worker --metrics-port`)
    metrics_every: int = 10  # steps per durable train_metrics event (mainspring report)

    def __post_init__(self) -> None:
        _positive(self, "heartbeat_timeout_s", "hang_timeout_s", "segment_budget_s",
                  "stop_grace_s", "metrics_every")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    run_id: str
    seed: int = 1234
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    spikes: SpikeConfig = field(default_factory=SpikeConfig)
    faults: tuple[FaultSpec, ...] = ()
    ops: OpsConfig = field(default_factory=OpsConfig)

    def __post_init__(self) -> None:
        _require(bool(RUN_ID_RE.match(self.run_id)), "run_id",
                 f"{self.run_id!r} is not a valid run id",
                 "use lowercase letters, digits and '-', starting with a letter or digit, "
                 "at most 63 characters")
        t, m = self.train, self.model
        _require(t.micro_batch_tokens % m.seq_len == 0, "train.micro_batch_tokens",
                 f"{t.micro_batch_tokens} is not a multiple of model.seq_len={m.seq_len}",
                 "make micro_batch_tokens a multiple of seq_len")
        _require(t.checkpoint_every <= t.segment_steps, "train.checkpoint_every",
                 "is longer than a segment", "make checkpoint_every <= segment_steps")
        lr_dim = self.sweep.space.get("lr")
        _require(not (self.sweep.enabled and lr_dim and lr_dim.low < t.min_lr),
                 "sweep.space.lr.low", f"is below train.min_lr={t.min_lr}",
                 "raise the sweep's lower bound or lower train.min_lr")

    # ---- (de)serialisation -------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Any) -> "RunSpec":
        return _build(cls, raw, "")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def spec_hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **sections: Any) -> "RunSpec":
        """Override fields by dotted name: spec.replace(**{"train.lr": 1e-3})."""
        return RunSpec.from_dict(deep_merge(self.to_dict(), dotted_to_nested(sections)))


def dotted_to_nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key != "space":
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _build(tp: Any, raw: Any, path: str) -> Any:
    """Turn JSON-ish `raw` into type `tp`, naming `path` in every error."""
    name = path or "spec"
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(raw, dict):
            raise BadConfig(name, f"expected an object, got {type(raw).__name__}",
                            "write it as a JSON object")
        hints = typing.get_type_hints(tp)
        known = {f.name for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise BadConfig(f"{path + '.' if path else ''}{unknown[0]}", "unknown field",
                            f"remove it; known fields here: {', '.join(sorted(known))}")
        kwargs = {k: _build(hints[k], v, f"{path + '.' if path else ''}{k}")
                  for k, v in raw.items()}
        try:
            return tp(**kwargs)
        except BadConfig as exc:  # the section's own check: prefix its field with the path
            full = f"{path + '.' if path else ''}{exc.field}"
            raise BadConfig(full, exc.problem, exc.fix) from None
        except TypeError as exc:  # a required field is missing
            raise BadConfig(name, str(exc), "add the missing field") from None
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(raw, (list, tuple)):
            raise BadConfig(name, f"expected a list, got {type(raw).__name__}", "write a JSON list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v, f"{name}[{i}]") for i, v in enumerate(raw))
        if len(raw) != len(args):
            raise BadConfig(name, f"expected {len(args)} items, got {len(raw)}",
                            f"give exactly {len(args)} values")
        return tuple(_build(a, v, f"{name}[{i}]") for i, (a, v) in enumerate(zip(args, raw)))
    if origin is dict:
        _, vt = typing.get_args(tp)
        if not isinstance(raw, dict):
            raise BadConfig(name, f"expected an object, got {type(raw).__name__}",
                            "write it as a JSON object")
        return {k: _build(vt, v, f"{name}.{k}") for k, v in raw.items()}
    if origin in (typing.Union, types.UnionType):
        raise BadConfig(name, "unsupported union type", "report this as a bug")
    if tp is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise BadConfig(name, f"expected a number, got {raw!r}", "write a number")
        return float(raw)
    if tp in (int, bool, str):
        if type(raw) is not tp:
            raise BadConfig(name, f"expected {tp.__name__}, got {raw!r}",
                            f"write a JSON {'boolean' if tp is bool else tp.__name__}")
        return raw
    raise BadConfig(name, f"unsupported type {tp!r}", "report this as a bug")


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
