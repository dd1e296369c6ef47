"""RunSpec's `spikes` section: the loss-spike detector (trainer/spikes.py), what the trainer
does about a spike (trainer/guard.py) and the rollback budget the workflow escalates on
(workflows/policy.py). Stdlib only; re-exported by spec."""

from __future__ import annotations

from dataclasses import dataclass, field

from spec.codec import STEPS, num
from spec.codec import positive as _positive
from spec.codec import require as _require


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
