"""Why a segment stops: the one owner of every exit reason of the step loop.

After each step the loop asks `Stopper.should_stop` once, with what the step and the online
evaluation found; the answer is the first reason that applies:

- `rollback_budget` — more rollbacks in this segment than `--max-rollbacks` allows: the
  segment ends early (on the restored, committed step) so the workflow can escalate the
  spike (an LR backoff, then a hold);
- `interrupted` — the supervisor's stop file or a SIGTERM (a preemption notice) on any rank:
  stop after this step, on a committed one;
- `overfitting` — validation loss rose while training loss fell (trainer/online_eval.py)
  and `train.early_stop_on_overfit` is set;
- `raise_batch` — the oscillation watch asked for a larger gradient accumulation
  (trainer/oscillation_watch.py), which the engine cannot change mid-segment: stop on a
  committed step so the workflow launches the next segment with it;
- `target` — the segment's last step is done: a normal end, not reported as a stop.

A segment that never reaches the loop reports `rollback_refused` (ROLLBACK_REFUSED): an
operator's rollback whose target retention removed meanwhile (trainer/segment.py).

A spike that cannot be rolled back at all (no checkpoint before its onset) is no stop but a
failure: the rollback raises Diverged (trainer/guard.py), which the segment's classified
exit reports (exit 3). Only this module sets `SegmentOutcome.stopped` during the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from common.protocol import SegmentOutcome

log = structlog.get_logger(__name__)

TARGET = "target"  # the segment reached its target step: not an early stop
# what outcome.stopped records
EARLY = ("rollback_budget", "interrupted", "overfitting", "raise_batch")
ROLLBACK_REFUSED = "rollback_refused"  # the operator's rollback target is gone: no training


@dataclass(frozen=True, kw_only=True)
class StopRules:
    """What ends a segment, from its arguments and spec."""

    target: int  # the segment's last step (--to-step)
    max_rollbacks: int = -1  # end early after this many rollbacks (-1: no limit)
    early_stop_on_overfit: bool = False  # train.early_stop_on_overfit


def stop_reason(rules: StopRules, *, step: int, rollbacks: int, signal: str = "",
                overfitting: bool = False, batch_asked: bool = False) -> str:
    """Why the segment ends after `step` ('' to go on): the first reason that applies."""
    if 0 <= rules.max_rollbacks < rollbacks:
        return "rollback_budget"
    if signal:
        return "interrupted"
    if overfitting and rules.early_stop_on_overfit:
        return "overfitting"
    if batch_asked and step < rules.target:
        return "raise_batch"
    if step >= rules.target:
        return TARGET
    return ""


class Stopper:
    """Counts the segment's rollbacks and decides, after every step, whether it ends."""

    def __init__(self, rules: StopRules, outcome: SegmentOutcome) -> None:
        self.rules, self.outcome = rules, outcome
        self.rollbacks = 0  # this segment's spike rollbacks

    def should_stop(self, step: int, *, rolled_back: bool = False, signal: str = "",
                    overfitting: bool = False) -> str:
        """The reason to stop after `step` ('' to go on); an early one is recorded in the
        outcome (result.json)."""
        self.rollbacks += rolled_back
        reason = stop_reason(self.rules, step=step, rollbacks=self.rollbacks, signal=signal,
                             overfitting=overfitting,
                             batch_asked=self.outcome.grad_accum_asked is not None)
        if reason in EARLY:
            self.outcome.stopped = reason
            log.warning("segment_stopping", step=step, reason=reason, signal=signal or None,
                        rollbacks=self.rollbacks)
        return reason
