"""RunSpec's `spikes` section: the loss-spike detector (trainer/spikes.py), what the trainer
does about a spike (trainer/guard.py) and the rollback budget the workflow escalates on
(workflows/policy.py). Stdlib only; re-exported by spec."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from spec.codec import STEPS, num, value_range
from spec.codec import positive as _positive
from spec.codec import require as _require
from spec.train import TrainConfig

# train.grad_accum's own upper limit (spec/train.py): a raised accumulation is a spec value
# too, so the oscillation's raise may never pass it
MAX_GRAD_ACCUM = int(next(value_range(f) for f in fields(TrainConfig)
                          if f.name == "grad_accum")[1])


@dataclass(frozen=True, kw_only=True)
class SpikeBudget:
    rollbacks: int = num(3, 1, 10**6)  # rollbacks allowed per `per_steps` before escalating
    per_steps: int = num(1000, 1, STEPS)

    def __post_init__(self) -> None:
        _positive(self, "rollbacks", "per_steps")


@dataclass(frozen=True, kw_only=True)
class OscillationConfig:
    """A loss that shakes rather than spikes (trainer/oscillation.py): a sustained rise of
    the loss's variance around its trend, measured per block of accepted losses and
    answered by a larger batch, a lower LR or the data path (trainer/oscillation_watch.py)."""

    # off by default: on the tiny e2e runs' noisy losses (lr 1e-2, 8-sequence batches) its
    # defaults judged an ordinary stretch after an operator's rollback as shaking, lowered the
    # LR and rolled back; turned on where a clean run of that model and batch shows none
    enabled: bool = False
    window: int = num(16, 4, 10**4)  # accepted losses per judged block (a robust trend each)
    warmup: int = num(32, 0, 10**6)  # accepted losses of a segment before its first block
    references: int = num(2, 1, 10**4)  # earlier blocks needed; their median is the reference
    ratio: float = num(9.0, 1, 1e6, lo_open=True)  # block / reference variance: an oscillation
    min_spread: float = num(0.005, 0, 1e6, lo_open=True)  # reference spread floor, of the loss
    noise_every: int = num(10, 0, STEPS)  # steps between gradient noise samples (0: never)
    batch_margin: float = num(2.0, 1, 1e6)  # noise scale above this x the batch: raise it
    # a raised grad_accum <= this x the spec's own train.grad_accum (batch_bound), and that
    # product <= train.grad_accum's limit (check_batch_bound, when the spec is read)
    max_batch_factor: int = num(4, 1, 1024)
    # the bound itself, in micro-batches (0: max_batch_factor x train.grad_accum). The
    # workflow sets it on the segments after a raise (workflows/carry_updates.py
    # segment_spec), so their bound stays the run's and is never re-derived from the raise.
    max_grad_accum: int = num(0, 0, MAX_GRAD_ACCUM)
    lr_factor: float = num(0.5, 0, 1, lo_open=True, hi_open=True)  # LR factor: step size suspect
    lr_steps: int = num(200, 1, STEPS)  # for this many steps
    # added fields at their default: out of spec_hash (spec/run.py, without_added)
    ADDED: ClassVar[dict[str, Any]] = {"max_grad_accum": 0}

    def __post_init__(self) -> None:
        _require(self.window >= 4, "window", f"must be >= 4, got {self.window}",
                 "use e.g. 16 (a trend needs a few points)")
        _positive(self, "references", "min_spread", "lr_steps", "max_batch_factor")
        _require(self.warmup >= 0, "warmup", "must be >= 0", "use 0 to judge from the start")
        _require(self.noise_every >= 0, "noise_every", "must be >= 0", "use 0 to never sample")
        _require(self.ratio > 1, "ratio", f"must be > 1, got {self.ratio}",
                 "use e.g. 9.0 (three times the spread)")
        _require(self.batch_margin >= 1, "batch_margin", f"must be >= 1, got "
                 f"{self.batch_margin}", "use e.g. 2.0")
        _require(0 < self.lr_factor < 1, "lr_factor", f"must be in (0, 1), got "
                 f"{self.lr_factor}", "use e.g. 0.5")


def batch_bound(grad_accum: int, cfg: OscillationConfig) -> int:
    """The one bound on the gradient accumulation an oscillation may raise to: the spec's
    `max_grad_accum`, else `grad_accum` (the spec's own train.grad_accum, the sweep's point
    applied) x max_batch_factor. A segment after a raise runs a spec that holds the run's
    bound (workflows/carry_updates.py segment_spec), so the trainer asks for no more than
    the workflow grants, and at the bound asks for nothing."""
    return cfg.max_grad_accum or grad_accum * cfg.max_batch_factor


def check_batch_bound(grad_accum: int, spikes: SpikeConfig) -> None:
    """RunSpec's rule across sections: where the oscillation may raise the batch (it and
    spike handling on), its bound stays within train.grad_accum's own limit, so a raise to
    it is a valid spec, not a BadConfig hours into the run."""
    cfg = spikes.oscillation
    if not (spikes.enabled and cfg.enabled):
        return
    if cfg.max_grad_accum:  # within the limit by its range; a bound below is no bound
        _require(cfg.max_grad_accum >= grad_accum, "spikes.oscillation.max_grad_accum",
                 f"is {cfg.max_grad_accum}, below train.grad_accum {grad_accum}",
                 "set it to at least train.grad_accum, or 0 for max_batch_factor x "
                 "train.grad_accum")
        return
    bound = batch_bound(grad_accum, cfg)
    _require(bound <= MAX_GRAD_ACCUM, "spikes.oscillation.max_batch_factor",
             f"{cfg.max_batch_factor} x train.grad_accum {grad_accum} = {bound}: a raise to "
             f"it would pass train.grad_accum's limit of {MAX_GRAD_ACCUM}",
             f"use a max_batch_factor of at most {max(1, MAX_GRAD_ACCUM // grad_accum)}, or "
             "a smaller train.grad_accum")


@dataclass(frozen=True, kw_only=True)
class SpikeConfig:
    """Loss-spike handling (trainer/spikes.py); thresholds in robust standard deviations."""

    enabled: bool = True
    window: int = num(50, 1, 10**6)  # accepted losses in the robust baseline (median / MAD)
    warmup: int = num(20, 0, 10**6)  # losses observed before the detector judges
    skip_threshold: float = num(6.0, 0, 1e6, lo_open=True)  # above median + k * spread: outlier
    return_threshold: float = num(4.0, 0, 1e6, lo_open=True)  # after one, above it: not back yet
    min_spread: float = num(0.01, 0, 1e6, lo_open=True)  # spread floor, of |median|, flat history
    patience: int = num(3, 1, 10**6)  # outliers within `window` steps that make a sustained spike
    skip_before: int = num(2, 0, STEPS)  # batches before the onset also skipped on rollback
    skip_window: int = num(16, 1, STEPS)  # batches skipped from there (PaLM: 200-500 at scale)
    # LR factor the workflow applies when the budget is spent
    lr_backoff: float = num(0.5, 0, 1, lo_open=True, hi_open=True)
    lr_backoff_steps: int = num(500, 1, STEPS)  # for this many steps
    budget: SpikeBudget = field(default_factory=SpikeBudget)
    oscillation: OscillationConfig = field(default_factory=OscillationConfig)
    # added fields at their default: out of spec_hash (spec/run.py, without_added)
    ADDED: ClassVar[dict[str, Any]] = {"oscillation": {
        "enabled": False, "window": 16, "warmup": 32, "references": 2, "ratio": 9.0,
        "min_spread": 0.005, "noise_every": 10, "batch_margin": 2.0, "max_batch_factor": 4,
        "lr_factor": 0.5, "lr_steps": 200}}

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
