"""The warm-up sweep's pruner: optuna's SuccessiveHalvingPruner, asked from the workflow's records.

As with the sampler (sweep/suggest.py), optuna keeps nothing between calls. The Sweep workflow
records each trial's held-out loss at every rung boundary it reached; each call rebuilds an
in-memory study from those records and asks the pruner about one trial:

- each trial is `create_trial(..., intermediate_values={step: loss})` in trial-index order,
  COMPLETE at its final loss, PRUNED, FAIL (diverged: no finite final loss) or RUNNING;
- optuna's successive halving reads the losses other trials had at a rung from their
  `completed_rung_<k>` system attributes, which its own `prune` writes as a trial reaches
  each rung. A rebuilt trial gets them from its records: the loss at each rung step it
  reached (never a NaN, which optuna prunes before recording it). The trial in question gets
  them for the rungs before the one it just reached, and is RUNNING, so the pruner can
  record that one itself;
- the pruner's min_resource is the first rung's step (spec/sweep.py rung_steps), so its
  promotion steps are the trial's segment boundaries, and its bootstrap count 0.

Successive halving draws no random numbers, so the same records give the same decision (a
replay reuses the recorded one anyway; an activity retry recomputes it). The study holds no
parameters: the pruner reads step values only. Called from the `prune_trial` activity only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import optuna
from optuna.pruners import SuccessiveHalvingPruner
from optuna.trial import TrialState

from spec.sweep import PruningConfig, rung_steps

STUDY_NAME = "mainspring-sweep-pruning"
STATES = {"running": TrialState.RUNNING, "complete": TrialState.COMPLETE,
          "diverged": TrialState.FAIL, "pruned": TrialState.PRUNED}
optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass(frozen=True)
class Trial:
    """One recorded trial: its status (a STATES key), its (step, held-out loss) at each rung
    boundary it reached, and a complete trial's final loss."""

    status: str
    rungs: Sequence[tuple[int, float]] = field(default_factory=tuple)
    val_loss: float | None = None


@dataclass(frozen=True)
class Decision:
    prune: bool
    rung: int  # the rung the trial just reached (0: the first boundary)
    step: int
    val_loss: float
    competing: int  # trials with a loss at that rung, the trial itself included
    better: int  # of them, those with a lower loss


def completed_rungs(trial: Trial, decision_steps: Sequence[int], upto: int) -> dict[str, float]:
    """optuna's `completed_rung_<k>` attributes for the trial's first `upto` rungs: its loss
    at each rung step it reached (a NaN is pruned without one)."""
    values = dict(trial.rungs)
    return {f"completed_rung_{k}": values[s] for k, s in enumerate(decision_steps[:upto])
            if s in values and not math.isnan(values[s])}


def frozen(trial: Trial, attrs: dict[str, float], running: bool) -> optuna.trial.FrozenTrial:
    state = TrialState.RUNNING if running else STATES[trial.status]
    done = trial.val_loss is not None and math.isfinite(trial.val_loss)
    if state == TrialState.COMPLETE and not done:
        state = TrialState.FAIL  # no finite value for optuna to hold
    return optuna.trial.create_trial(
        state=state, value=trial.val_loss if state == TrialState.COMPLETE else None,
        intermediate_values={int(s): float(v) for s, v in trial.rungs}, system_attrs=attrs)


def decide(cfg: PruningConfig, trial_steps: int, trials: Sequence[Trial], index: int) -> Decision:
    """Whether trial `index`, at the rung boundary its last recorded loss was measured at,
    stops there: optuna's SuccessiveHalvingPruner over a study rebuilt from `trials`."""
    steps = rung_steps(cfg, trial_steps)[:-1]  # the decision points: every boundary but the last
    subject = trials[index]
    step, value = subject.rungs[-1]
    if step not in steps:
        raise ValueError(f"trial {index} reports step {step}, not a rung boundary {steps}")
    rung = steps.index(step)
    study = optuna.create_study(study_name=STUDY_NAME, direction="minimize",
                                sampler=optuna.samplers.RandomSampler(seed=0))
    study.add_trials([frozen(t, completed_rungs(t, steps, rung if i == index else len(steps)),
                             running=i == index) for i, t in enumerate(trials)])
    pruner = SuccessiveHalvingPruner(min_resource=steps[0], reduction_factor=cfg.reduction_factor,
                                     min_early_stopping_rate=0, bootstrap_count=0)
    prune = pruner.prune(study, study.get_trials(deepcopy=False)[index])
    key = f"completed_rung_{rung}"
    competing = [v for i, t in enumerate(trials) if i != index
                 for k, v in completed_rungs(t, steps, len(steps)).items() if k == key]
    return Decision(prune=prune, rung=rung, step=int(step), val_loss=float(value),
                    competing=len(competing) + 1,
                    better=sum(1 for v in competing if v < value))
