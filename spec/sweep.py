"""RunSpec's `sweep` section: the warm-up sweep the Sweep child workflow runs (workflows/sweep.py)
over a search space the suggester samples (sweep/suggest.py). `sweep_ends` gives the values
at both ends of a swept dimension, which RunSpec checks as whole trials. Stdlib only;
re-exported by spec."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from spec.codec import STEPS, num
from spec.codec import positive as _positive
from spec.codec import require as _require

SWEPT = ("lr", "weight_decay", "warmup_steps")  # the train fields a sweep may search
SAMPLERS = ("tpe", "gp")  # optuna's TPESampler (multivariate, constant liar) | GPSampler


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

    # Added fields, with the default they came with: out of spec_hash at that default
    # (spec/run.py without_added), so a run claimed before they existed keeps its hash.
    ADDED: ClassVar[dict[str, Any]] = {"sampler": "tpe"}

    enabled: bool = True
    space: dict[str, SearchDim] = field(
        default_factory=lambda: {"lr": SearchDim(low=1e-3, high=1e-2, log=True)})
    trials: int = num(2, 1, 1000)  # trial run ids end in -trial-<index>: 3 digits at most
    parallel: int = num(1, 1, 256)
    trial_steps: int = num(30, 1, STEPS)
    # the suggest activity's optuna sampler (activities/suggest.py): "tpe" (TPESampler,
    # multivariate, constant liar) or "gp" (GPSampler, log expected improvement)
    sampler: str = "tpe"

    def __post_init__(self) -> None:
        _positive(self, "trials", "parallel", "trial_steps")
        _require(self.sampler in SAMPLERS, "sampler", f"unknown sampler {self.sampler!r}",
                 f"use one of {', '.join(SAMPLERS)}")
        _require(set(self.space) <= set(SWEPT), "space",
                 f"unknown parameter(s) {sorted(set(self.space) - set(SWEPT))}",
                 "sweep lr, weight_decay or warmup_steps")
        _require(not self.enabled or self.trials >= 2, "trials", "a sweep needs >= 2 trials",
                 "raise trials or set enabled=false")


def sweep_ends(name: str, dim: SearchDim) -> tuple[tuple[str, float | int], ...]:
    """(end, value) at both ends of a swept dimension, as the suggester may pick them
    (optuna samples inside [low, high], bounds included) and `trial_spec` (int) applies them."""
    high = dim.low * (dim.high / dim.low) ** 1.0 if dim.log else dim.low + (dim.high - dim.low)
    ends = (("low", dim.low), ("high", high))
    if name == "warmup_steps":
        return tuple((end, int(float(round(v)))) for end, v in ends)
    return ends
