"""The checkpoint interval of `train.checkpoint_every: "auto"`, chosen by the
workflow before each segment from what the run has measured. Pure and I/O-free; imported
by workflows/training_run.py in the sandbox.

Young's first-order optimum (J. W. Young, "A first order approximation to the optimum
checkpoint interval", CACM 17(9), 1974; Daly's refinement, FGCS 22(3), 2006, agrees to
first order): with a checkpoint costing C seconds of stall and faults arriving every M
seconds on average, the work lost to checkpoints (C per interval) plus to faults (half an
interval, on average, per fault) is least at tau = sqrt(2 C M). Near tau the waste is flat
- an interval off by 1.5x wastes about 8 % more than the best one - so estimates of C and
M that are right within a factor of two are good enough.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from spec import RunSpec
from workflows.carry import RunCarry


def young_daly_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Seconds between checkpoints: sqrt(2 x cost x MTBF) (Young 1974)."""
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def young_daly_steps(checkpoint_cost_s: float, mtbf_s: float, step_time_s: float,
                     lo: int, hi: int) -> int:
    """The Young-Daly interval in steps of `step_time_s` seconds, nearest, within [lo, hi]."""
    steps = round(young_daly_s(checkpoint_cost_s, mtbf_s) / step_time_s)
    return min(hi, max(lo, steps))


def observed_mtbf(train_wall_s: float, faults: int, prior_mtbf_s: float,
                  prior_faults: int) -> float:
    """The run's mean time between faults: its training wall time over its faults, with the
    prior standing in for the `prior_faults - faults` faults not yet seen, each after
    `prior_mtbf_s`. No faults yet: the prior, raised by the fault-free time spread over
    its faults; from `prior_faults` faults on: the run's own rate alone (wall / faults, the
    maximum-likelihood estimate for faults at a constant rate), so a wrong guess is gone
    after a few faults instead of weighing on the estimate for the rest of the run."""
    missing = max(0, prior_faults - faults)
    return (train_wall_s + missing * prior_mtbf_s) / max(faults, prior_faults)


@dataclass(frozen=True)
class Interval:
    """The chosen interval in steps, and the `checkpoint_interval` event's payload: the
    inputs it came from, so the choice can be checked by hand."""

    steps: int
    payload: dict[str, Any]


def choose(spec: RunSpec, c: RunCarry) -> Interval:
    """The interval for the next segment of a run with `checkpoint_every: "auto"`, from the
    carry's measurements. Before a checkpoint stall and a step time are measured (a run's
    first segment): the lower bound - the cheapest protection against a fault that comes
    early, and it measures the stall soonest."""
    t, ops, m = spec.train, spec.ops, c.interval
    lo, hi = t.checkpoint_every_min, t.segment_steps
    mtbf = observed_mtbf(m.train_wall_s, m.faults_seen, ops.mtbf_s, ops.mtbf_prior_faults)
    payload: dict[str, Any] = {
        "min_steps": lo, "max_steps": hi, "faults": m.faults_seen,
        "train_wall_s": round(m.train_wall_s, 3), "prior_mtbf_s": ops.mtbf_s,
        "prior_faults": ops.mtbf_prior_faults, "mtbf_s": round(mtbf, 3),
        "mtbf_source": "observed" if m.faults_seen >= ops.mtbf_prior_faults else "prior",
        "checkpoints_measured": m.checkpoints_measured}
    if not m.checkpoints_measured or not m.step_time_s:
        return Interval(lo, {**payload, "steps": lo, "how": "no checkpoint measured yet: "
                             "the lower bound"})
    cost = m.checkpoint_stall_s / m.checkpoints_measured
    tau = young_daly_s(cost, mtbf)
    steps = young_daly_steps(cost, mtbf, m.step_time_s, lo, hi)
    prior = young_daly_steps(cost, ops.mtbf_s, m.step_time_s, lo, hi)
    clamped = " (clamped)" if steps != round(tau / m.step_time_s) else ""
    return Interval(steps, {
        **payload, "steps": steps, "seconds": round(steps * m.step_time_s, 3),
        "young_daly_s": round(tau, 3), "checkpoint_cost_s": round(cost, 4),
        "step_time_s": round(m.step_time_s, 4), "steps_at_prior": prior,
        "how": f"sqrt(2 x {cost:.3g}s x {mtbf:.4g}s) = {tau:.3g}s = "
               f"{tau / m.step_time_s:.1f} steps of {m.step_time_s:.3g}s, in [{lo}, {hi}]"
               f"{clamped}"})
