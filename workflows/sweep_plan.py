"""The warm-up sweep's plan: its rounds, each trial's run id and spec, and a spec with the
parameters a sweep chose. Deterministic and I/O-free; imported by the workflows inside the
sandbox.
"""

from __future__ import annotations

import math

from spec import RunSpec, SweepConfig
from spec.sweep import point_overrides, rung_steps, trial_overrides


def initial_trials(cfg: SweepConfig) -> int:
    """Round 0's size: the scaling-law prior and the sampler's start-up points (>= 2,
    >= dims + 1, as the suggest activity's n_startup_trials), at least one parallel round."""
    return min(cfg.trials, max(2, len(cfg.space) + 1, cfg.parallel))


def sweep_rounds(cfg: SweepConfig) -> list[int]:
    """Trials per round: the first round, then `parallel` suggestions at a time. Fixed in
    recorded histories (one suggest_trials local activity a round): keep it so, or patch."""
    rounds = [initial_trials(cfg)]
    while sum(rounds) < cfg.trials:
        rounds.append(min(cfg.parallel, cfg.trials - sum(rounds)))
    return rounds


def trial_run_id(run_id: str, index: int) -> str:
    return f"{run_id[:50]}-trial-{index}"


def trial_spec(spec: RunSpec, index: int, params: dict[str, float]) -> RunSpec:
    """A short run of its own (own run id and checkpoints), faults off, on one node with the
    run's global batch (workflows/gang.py), params applied (spec/sweep.py trial_overrides:
    each swept parameter to its train field, batch_tokens to grad_accum)."""
    return spec.replace(**{"run_id": trial_run_id(spec.run_id, index),
                           **trial_overrides(params, spec.train, spec.sweep)})


def trial_eval_every(cfg: SweepConfig) -> int:
    """A trial's `train.eval_every` when its segments score it themselves: every step at
    which the sweep reads its held-out loss (each rung boundary, the last step) is a multiple
    of it, so the segment's own online evaluation there is the trial's score, on the same
    held-out batches the evaluate activity would read, without that activity's process."""
    return math.gcd(*rung_steps(cfg.pruning, cfg.trial_steps)) or cfg.trial_steps


def with_params(spec: RunSpec, params: dict[str, float]) -> RunSpec:
    """The main run with the sweep's winning point applied, as each trial applied it."""
    return spec.replace(**point_overrides(params, spec.train))
