"""The warm-up sweep's suggestions: optuna's samplers, asked and told from the workflow's records.

The Sweep workflow owns the study: it records every suggestion (params and their
distributions, plain JSON) and every result in its history. Each call here rebuilds an
in-memory study from those records (`optuna.trial.create_trial` + `study.add_trials`) and asks
it for the next points, so optuna holds no state between calls and a replay or an activity
retry, given the same records, suggests the same points:

- the sampler is seeded from (run seed, number of recorded trials): optuna keeps no sampler
  RNG state of its own to restore (optuna PR #3992);
- the study name is fixed (HyperbandPruner picks a trial's bracket from a hash of the study
  name and trial number);
- a trial that died (no result) is told FAIL, never RUNNING: TPE's constant liar (on by
  default in optuna 5) would otherwise treat it as in flight forever and steer around it;
- a trial that diverged (non-finite held-out loss) is told COMPLETE at the worst finite loss
  seen: FAIL would teach the sampler nothing, and it would go on sampling the too-high
  learning rates that diverge;
- a trial the pruner stopped at a rung boundary (sweep/prune.py) is told PRUNED with its
  held-out loss at each rung it reached as intermediate values: TPE ranks pruned trials
  below complete ones, by how far they got and then by their last loss.

Each dimension is a parameter of spec/sweep.py SWEPT: real (lr, weight_decay, beta2,
grad_clip) or whole (warmup_steps, batch_tokens; the batch also snapped to whole
accumulation steps after the ask, so the recorded point is the one a trial trains).
Trial 0 is the prior (sweep/prior.py: Step Law's learning rate, the main run's own value of
every other parameter), enqueued before the first ask. Called from
the `suggest_trials` activity only; workflow code never imports optuna (pyproject's
import-linter contracts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
    json_to_distribution,
)
from optuna.trial import TrialState

from spec import SweepConfig
from spec.sweep import INTEGER

Params = dict[str, float]
STUDY_NAME = "mainspring-sweep"  # fixed: optuna derives per-trial randomness from it
SEED_STRIDE = 1_000_003  # a new sampler stream per round: seed · stride + recorded trials
# optuna's own INFO line per trial would repeat what the sweep_trial events already say
optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass(frozen=True)
class Dim:
    """One swept hyperparameter."""

    name: str
    low: float
    high: float
    log: bool = False  # searched in log space (low > 0)
    integer: bool = False  # a whole number (warmup_steps, batch_tokens)
    unit: int = 1  # an integer dimension's points are whole multiples of it (batch_tokens)

    @property
    def bounds(self) -> tuple[float, float]:
        """The lowest and highest point: whole multiples of `unit` for an integer dimension."""
        if not self.integer:
            return self.low, self.high
        u = self.unit
        return math.ceil(self.low / u) * u, math.floor(self.high / u) * u

    def snap(self, value: float) -> float:
        """`value` inside the bounds; an integer dimension's to the nearest multiple of `unit`."""
        lo, hi = self.bounds
        if self.integer:
            value = round(value / self.unit) * self.unit
        return float(min(hi, max(lo, value)))


@dataclass(frozen=True)
class Record:
    """One recorded trial: its params, their distributions (optuna JSON), its held-out loss
    (None or non-finite: diverged), whether it died without a result, and whether the
    pruner stopped it, with its (step, loss) at each rung boundary it reached."""

    params: Params
    distributions: dict[str, str]
    val_loss: float | None
    dead: bool = False
    pruned: bool = False
    rungs: Sequence[tuple[int, float]] = ()


def sweep_space(cfg: SweepConfig, batch_unit: int = 1) -> list[Dim]:
    """The swept dimensions in name order; warmup_steps and batch_tokens in whole numbers,
    the batch in whole accumulation steps of `batch_unit` tokens (spec/sweep.py
    accumulation_tokens)."""
    return [Dim(name, d.low, d.high, d.log, integer=name in INTEGER,
                unit=batch_unit if name == "batch_tokens" else 1)
            for name, d in sorted(cfg.space.items())]


def distribution(dim: Dim) -> BaseDistribution:
    if dim.integer:
        return IntDistribution(math.ceil(dim.low), math.floor(dim.high), log=dim.log)
    return FloatDistribution(dim.low, dim.high, log=dim.log)


def distributions_json(space: Sequence[Dim]) -> dict[str, str]:
    """What the workflow records beside each suggestion."""
    return {d.name: distribution_to_json(distribution(d)) for d in space}


def sampler_for(kind: str, seed: int, startup: int) -> optuna.samplers.BaseSampler:
    """TPE (multivariate, constant liar: points asked in one round differ) or GP."""
    if kind == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True,
                                      constant_liar=True)


def finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def frozen(record: Record, worst: float | None) -> optuna.trial.FrozenTrial:
    """A COMPLETE trial, a diverged one at `worst` (the worst finite loss recorded), PRUNED
    with its rung losses, or FAIL: dead, or diverged with no finite loss to stand for it."""
    dists = {k: json_to_distribution(v) for k, v in record.distributions.items()}
    params: dict[str, Any] = {k: int(round(v)) if isinstance(dists[k], IntDistribution) else v
                              for k, v in record.params.items()}
    if record.pruned and not record.dead:
        return optuna.trial.create_trial(
            params=params, distributions=dists, state=TrialState.PRUNED,
            intermediate_values={int(step): float(v) for step, v in record.rungs})
    value = record.val_loss if finite(record.val_loss) else worst
    if record.dead or value is None:
        return optuna.trial.create_trial(params=params, distributions=dists,
                                         state=TrialState.FAIL)
    return optuna.trial.create_trial(params=params, distributions=dists, value=value)


def rebuild(records: Sequence[Record], kind: str, seed: int, startup: int) -> optuna.Study:
    """An in-memory study holding `records`, its sampler seeded from (seed, len(records))."""
    study = optuna.create_study(
        study_name=STUDY_NAME, direction="minimize",
        sampler=sampler_for(kind, (seed * SEED_STRIDE + len(records)) % 2**32, startup))
    losses = [r.val_loss for r in records
              if not r.dead and not r.pruned and finite(r.val_loss)]
    worst = max(losses) if losses else None
    study.add_trials([frozen(r, worst) for r in records])
    return study


def suggest(space: Sequence[Dim], records: Sequence[Record], count: int, *, seed: int,
            kind: str = "tpe", prior: Params | None = None, startup: int = 2) -> list[Params]:
    """`count` new points. `prior` (params, clipped into the space) is enqueued first when
    no trial is recorded yet: it becomes trial 0."""
    study = rebuild(records, kind, seed, startup)
    dists = {d.name: distribution(d) for d in space}
    if prior and not records:
        study.enqueue_trial(clip(space, prior), skip_if_exists=True)
    points = []
    for _ in range(count):  # asked, never told: the rest of the round sees them RUNNING
        trial = study.ask(dists)
        points.append({d.name: d.snap(float(trial.params[d.name])) for d in space})
    return points


def clip(space: Sequence[Dim], params: Params) -> dict[str, Any]:
    """`params` inside the space's bounds (integers rounded, the batch to whole
    accumulation steps); names outside it dropped."""
    out: dict[str, Any] = {}
    for d in space:
        if d.name in params:
            v = d.snap(params[d.name])
            out[d.name] = int(v) if d.integer else v
    return out
