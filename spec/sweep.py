"""RunSpec's `sweep` section: the warm-up sweep the Sweep child workflow runs (workflows/sweep.py)
over a search space the suggester samples (sweep/suggest.py), and the pure rules that turn a
swept point into train fields (`point_overrides`, `trial_overrides`), give the values at both
ends of a swept dimension (`sweep_ends`, which RunSpec checks as whole trials), and weigh the
sweep's compute against the main run's (`sweep_budget`), and the steps at which a pruned sweep
may stop a trial (`rung_steps`). Stdlib only; re-exported by spec."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from spec.codec import STEPS, num
from spec.codec import positive as _positive
from spec.codec import require as _require
from spec.train import TrainConfig

# The hyperparameters a sweep may search, each with the train field it sets. batch_tokens is
# the global batch in tokens: it sets train.grad_accum (micro_batch_tokens x ranks x
# grad_accum tokens a step), so its bounds are whole multiples of one accumulation step.
SWEPT: dict[str, str] = {
    "lr": "train.lr", "warmup_steps": "train.warmup_steps",
    "weight_decay": "train.weight_decay", "beta2": "train.betas[1]",
    "grad_clip": "train.grad_clip", "batch_tokens": "train.grad_accum"}
INTEGER = ("warmup_steps", "batch_tokens")  # searched in whole numbers
SAMPLERS = ("tpe", "gp")  # optuna's TPESampler (multivariate, constant liar) | GPSampler


@dataclass(frozen=True, kw_only=True)
class SearchDim:
    low: float = num(lo=0, hi=STEPS, hi_open=True)  # below high
    high: float = num(lo=0, hi=STEPS, lo_open=True)  # above low
    log: bool = True

    def __post_init__(self) -> None:
        _require(self.low < self.high, "low", "must be below high", "swap low and high")
        # >= 1e-12: high / low stays finite, and so does every point the suggester picks
        _require(not self.log or self.low >= 1e-12, "low", "log scale needs low >= 1e-12",
                 "use a positive low or log=false")


@dataclass(frozen=True, kw_only=True)
class PruningConfig:
    """Successive halving at rung boundaries (optuna's SuccessiveHalvingPruner, asked by the
    `prune_trial` activity): a trial trains in `rungs` segments, the first `min_steps` =
    trial_steps // reduction_factor^(rungs - 1) long, each later boundary reduction_factor
    times the last, the last at trial_steps. At each boundary but the last its held-out loss
    is compared with every other trial's at that step and, outside the best 1 /
    reduction_factor of them, the trial stops there (`rung_steps`)."""

    rungs: int = num(1, 1, 16)  # segments a trial trains in; 1: no pruning (a trial trains whole)
    reduction_factor: int = num(3, 2, 100)  # optuna's eta: 1 / eta of a rung go on

    def __post_init__(self) -> None:
        _positive(self, "rungs")
        _require(self.reduction_factor >= 2, "reduction_factor", "must be >= 2",
                 "use 2 or more (3 keeps the best third of each rung)")

    @property
    def enabled(self) -> bool:
        return self.rungs > 1


def rung_steps(pruning: PruningConfig, trial_steps: int) -> list[int]:
    """Pure: the steps at which a trial's segments end, the last at `trial_steps`: one
    segment without pruning, else min_steps x reduction_factor^k for each rung k but the
    last (the points optuna's SuccessiveHalvingPruner promotes at, min_resource
    min_steps), then `trial_steps`. Empty when trial_steps is too short for the rungs."""
    if not pruning.enabled:
        return [trial_steps]
    eta = pruning.reduction_factor
    first = trial_steps // eta ** (pruning.rungs - 1)
    if first < 1:
        return []
    return [first * eta ** k for k in range(pruning.rungs - 1)] + [trial_steps]


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """Warm-up sweep: short trials over `space`, best held-out loss wins."""

    # Added fields, with the default they came with: out of spec_hash at that default
    # (spec/run.py without_added), so a run claimed before they existed keeps its hash.
    ADDED: ClassVar[dict[str, Any]] = {"sampler": "tpe", "budget_fraction": 0.0,
                                       "pruning": {"rungs": 1, "reduction_factor": 3}}

    enabled: bool = True
    # name -> {low, high, log}; names from SWEPT. warmup_steps and batch_tokens are whole
    # numbers; the rest are real. Each end must make a valid trial and a valid main run.
    space: dict[str, SearchDim] = field(
        default_factory=lambda: {"lr": SearchDim(low=1e-3, high=1e-2, log=True)})
    trials: int = num(2, 1, 1000)  # trial run ids end in -trial-<index>: 3 digits at most
    parallel: int = num(1, 1, 256)
    # "auto": the longest trials `budget_fraction` allows at `trials` (sized_trial_steps; the
    # run's spec holds the number it came to)
    trial_steps: int | str = num(30, 1, STEPS, words=("auto",))
    # the suggest activity's optuna sampler (activities/suggest.py): "tpe" (TPESampler,
    # multivariate, constant liar) or "gp" (GPSampler, log expected improvement)
    sampler: str = "tpe"
    # The most the sweep may cost, as a fraction of the main run's planned tokens: trials x
    # trial_steps x the largest global batch a trial may use, against train.total_steps x
    # the run's global batch (`sweep_budget`). Over it the spec is refused, naming both
    # figures. 0: no budget (what a spec written before this field meant).
    budget_fraction: float = num(0.0, 0, 1)
    # Stop losing trials at rung boundaries (successive halving): {"rungs": 3,
    # "reduction_factor": 3} trains each trial in segments ending at trial_steps / 9,
    # trial_steps / 3 and trial_steps, and keeps the best third of each rung going. The
    # default, one rung, trains every trial whole, as a spec written before this field did.
    pruning: PruningConfig = field(default_factory=PruningConfig)

    def __post_init__(self) -> None:
        # Every rule that does not need the trial length first: with trial_steps "auto" the
        # section is read now and sized later (RunSpec), and each refusal must come while
        # the reader still names it sweep.<field>.
        _positive(self, "trials", "parallel")
        _require(self.sampler in SAMPLERS, "sampler", f"unknown sampler {self.sampler!r}",
                 f"use one of {', '.join(SAMPLERS)}")
        _require(set(self.space) <= set(SWEPT), "space",
                 f"unknown parameter(s) {sorted(set(self.space) - set(SWEPT))}",
                 f"sweep any of {', '.join(SWEPT)}")
        for name in INTEGER:
            dim = self.space.get(name)
            _require(dim is None or math.ceil(dim.low) <= math.floor(dim.high),
                     f"space.{name}", "holds no whole number between low and high",
                     f"{name} is a whole number: widen the range to include one")
        _require(not self.enabled or self.trials >= 2, "trials", "a sweep needs >= 2 trials",
                 "raise trials or set enabled=false")
        if self.trial_steps == "auto":  # sized against the run (RunSpec: sized_trial_steps,
            # which also holds the pruning rungs' minimum)
            _require(self.budget_fraction > 0, "trial_steps",
                     '"auto" sizes the trials from budget_fraction, which is 0 (no budget)',
                     "set sweep.budget_fraction (e.g. 0.1), or give trial_steps in steps")
            return
        _require(isinstance(self.trial_steps, int) and self.trial_steps > 0, "trial_steps",
                 f'must be > 0 or "auto", got {self.trial_steps!r}',
                 'set trial_steps to a positive number of steps, or "auto" with a budget')
        if self.pruning.enabled and not rung_steps(self.pruning, self.trial_steps):
            p = self.pruning
            need = p.reduction_factor ** (p.rungs - 1)
            _require(False, "pruning.rungs",
                     f"{p.rungs} rungs at reduction_factor {p.reduction_factor} need trial_steps "
                     f">= {need} (the first rung ends at trial_steps / {need}), got "
                     f"{self.trial_steps}",
                     "lower sweep.pruning.rungs or sweep.pruning.reduction_factor, or raise "
                     "sweep.trial_steps")


def tokens_per_step(train: TrainConfig) -> int:
    """The main run's global batch in tokens: micro_batch_tokens x ranks x grad_accum."""
    return train.micro_batch_tokens * train.world_size * train.grad_accum


def accumulation_tokens(train: TrainConfig) -> int:
    """Tokens in one accumulation step across the run's ranks: batch_tokens' unit."""
    return train.micro_batch_tokens * train.world_size


def main_values(train: TrainConfig) -> dict[str, float]:
    """The main run's own value of every parameter a sweep may search (the prior's point
    for all but lr)."""
    return {"lr": train.lr, "warmup_steps": float(train.warmup_steps),
            "weight_decay": train.weight_decay, "beta2": train.betas[1],
            "grad_clip": train.grad_clip, "batch_tokens": float(tokens_per_step(train))}


def point_overrides(params: Mapping[str, float], train: TrainConfig,
                    ranks: int | None = None) -> dict[str, Any]:
    """The dotted train fields a swept point sets, on `ranks` ranks (default: the run's).
    batch_tokens becomes grad_accum: the batch over the tokens one accumulation step of
    those ranks holds (at least 1)."""
    out: dict[str, Any] = {}
    for name, value in params.items():
        if name == "beta2":
            out["train.betas"] = [train.betas[0], value]
        elif name == "batch_tokens":
            step = train.micro_batch_tokens * (ranks or train.world_size)
            out["train.grad_accum"] = max(1, int(round(value / step)))
        elif name == "warmup_steps":
            out["train.warmup_steps"] = int(round(value))
        else:
            out[f"train.{name}"] = value
    return out


def trial_overrides(params: Mapping[str, float], train: TrainConfig,
                    sweep: SweepConfig) -> dict[str, Any]:
    """A trial: trial_steps long, one segment and one checkpoint, faults off, on one node
    with the run's global batch (decision 65), then the point applied."""
    steps = sweep.trial_steps
    # The budget weighs the sweep against the main run and was checked there; read in a
    # trial, whose own total_steps is one trial's, it would refuse every trial. Cleared only
    # where it was set, so every other trial's spec (and hash) is as it always was.
    budget = {"sweep.budget_fraction": 0.0} if sweep.budget_fraction else {}
    return {"faults": [], "train.total_steps": steps, "train.segment_steps": steps,
            "train.checkpoint_every": steps,
            "train.warmup_steps": min(train.warmup_steps, steps // 5),
            "train.nodes": 1, "train.min_nodes": 0,
            "train.grad_accum": train.grad_accum * train.nodes,
            **budget, **point_overrides(params, train, ranks=train.procs_per_node)}


def sweep_ends(name: str, dim: SearchDim) -> tuple[tuple[str, float | int], ...]:
    """(end, value) at both ends of a swept dimension, as the suggester may pick them
    (optuna samples inside [low, high], bounds included) and `trial_spec` (int) applies them."""
    high = dim.low * (dim.high / dim.low) ** 1.0 if dim.log else dim.low + (dim.high - dim.low)
    ends = (("low", dim.low), ("high", high))
    if name in INTEGER:
        return tuple((end, int(float(round(v)))) for end, v in ends)
    return ends


@dataclass(frozen=True)
class Budget:
    """The sweep's planned compute against the main run's, in tokens."""

    trials: int
    trial_steps: int
    trial_tokens_per_step: int  # the largest global batch a trial may use
    main_steps: int
    main_tokens_per_step: int
    fraction: float  # sweep.budget_fraction; 0: no budget

    @property
    def sweep_tokens(self) -> int:
        return self.trials * self.trial_steps * self.trial_tokens_per_step

    @property
    def main_tokens(self) -> int:
        return self.main_steps * self.main_tokens_per_step

    @property
    def allowed_tokens(self) -> float:
        return self.fraction * self.main_tokens

    @property
    def over(self) -> bool:
        return self.fraction > 0 and self.sweep_tokens > self.allowed_tokens

    @property
    def max_trial_steps(self) -> int:
        """The longest trials that fit the budget at this many trials."""
        return int(self.allowed_tokens // (self.trials * self.trial_tokens_per_step))

    @property
    def max_trials(self) -> int:
        """The most trials that fit the budget at this trial length."""
        return int(self.allowed_tokens // (self.trial_steps * self.trial_tokens_per_step))

    def problem(self) -> str:
        return (f"the sweep plans {self.sweep_tokens:,} tokens (trials {self.trials} x "
                f"trial_steps {self.trial_steps} x {self.trial_tokens_per_step:,} tokens a "
                f"step), {self.sweep_tokens / self.main_tokens:.1%} of the main run's "
                f"{self.main_tokens:,} (train.total_steps {self.main_steps} x "
                f"{self.main_tokens_per_step:,} tokens a step); budget_fraction "
                f"{self.fraction:g} allows {int(self.allowed_tokens):,}")

    def fix(self) -> str:
        return (f"lower sweep.trial_steps to at most {self.max_trial_steps} or sweep.trials "
                f"to at most {self.max_trials}"
                + (" (a sweep needs >= 2)" if self.max_trials < 2 else "")
                + ", or raise sweep.budget_fraction (or train.total_steps)")


def sweep_budget(sweep: SweepConfig, train: TrainConfig) -> Budget:
    """Pure: the sweep's planned tokens against the main run's. A trial steps with the
    run's global batch, or with the top of the batch_tokens range when that is swept
    (trial_steps "auto", not sized yet, plans none)."""
    main = tokens_per_step(train)
    batch = sweep.space.get("batch_tokens")
    trial = int(sweep_ends("batch_tokens", batch)[1][1]) if batch else main
    steps = sweep.trial_steps if isinstance(sweep.trial_steps, int) else 0
    return Budget(trials=sweep.trials, trial_steps=steps,
                  trial_tokens_per_step=trial, main_steps=train.total_steps,
                  main_tokens_per_step=main, fraction=sweep.budget_fraction)


def sized_trial_steps(sweep: SweepConfig, train: TrainConfig) -> int:
    """Pure: what `trial_steps: "auto"` comes to: the longest trials whose `trials` fit
    `budget_fraction` of the main run's tokens (each at the largest batch a trial may use),
    refused when that is too short to train (or, pruned, to reach its first rung)."""
    budget = sweep_budget(sweep, train)
    steps = budget.max_trial_steps
    need = sweep.pruning.reduction_factor ** (sweep.pruning.rungs - 1)
    _require(steps >= need, "sweep.trial_steps",
             f'"auto" comes to {steps} steps a trial: budget_fraction {sweep.budget_fraction:g} '
             f"of the main run's {budget.main_tokens:,} tokens is {int(budget.allowed_tokens):,}"
             f", over {sweep.trials} trials of {budget.trial_tokens_per_step:,} tokens a step"
             + (f" (the pruning rungs need >= {need})" if need > 1 else ""),
             "raise sweep.budget_fraction or train.total_steps, or lower sweep.trials"
             + (" or sweep.pruning.rungs" if need > 1 else ""))
    return steps
