"""Spike escalation: what the workflow does after a segment's trainer rolled back (continue,
lower the LR, pause for a human), the rollback budget the next segment gets, and which
rollback steps the carry must keep to count it. Deterministic and I/O-free.
"""

from __future__ import annotations

from spec import SpikeConfig

ESCALATE_CONTINUE, ESCALATE_LOWER_LR, ESCALATE_PAUSE = "continue", "lower_lr", "pause"


def escalate(rollback_steps: tuple[int, ...], step: int, lowered_at: tuple[int, ...],
             cfg: SpikeConfig) -> tuple[str, str]:
    """What the workflow does after a segment reported rollbacks: (action, reason).

    Within the budget's window: continue. Over budget: lower the LR (once per window);
    still over budget after lowering it: pause the run for a human rather than loop.
    """
    horizon = step - cfg.budget.per_steps
    recent = [s for s in rollback_steps if s > horizon]
    if len(recent) <= cfg.budget.rollbacks:
        return ESCALATE_CONTINUE, f"{len(recent)} rollbacks in {cfg.budget.per_steps} steps"
    if not any(s > horizon for s in lowered_at):
        return ESCALATE_LOWER_LR, (f"{len(recent)} rollbacks in {cfg.budget.per_steps} steps "
                                   f"exceed the budget of {cfg.budget.rollbacks}")
    return ESCALATE_PAUSE, (f"{len(recent)} rollbacks in {cfg.budget.per_steps} steps even "
                            f"after lowering the LR at step {max(lowered_at)}")


def lower_lr_window(step: int, cfg: SpikeConfig) -> list[float]:
    """ESCALATE_LOWER_LR's LR window [start, end, factor] from `step`."""
    return [step, step + cfg.lr_backoff_steps, cfg.lr_backoff]


def rollback_allowance(rollback_steps: list[int], budget_from: int, step: int,
                       cfg: SpikeConfig) -> int:
    """Rollbacks the next segment may do before it must end early and let the workflow
    escalate: what is left of the budget in the window ending at `step` (-1: handling off)."""
    if not cfg.enabled:
        return -1
    horizon = step - cfg.budget.per_steps
    used = sum(1 for s in rollback_steps if s >= budget_from and s > horizon)
    return max(0, cfg.budget.rollbacks - used)


def still_counted(steps: list[int], budget_from: int, floor: int, cfg: SpikeConfig) -> list[int]:
    """The entries of rollback_steps / lowered_at that escalate() and rollback_allowance()
    can still count, so the carry stays bounded. Both count a step s only when
    s >= budget_from and s > step - per_steps for the step they are asked about, and the run
    never goes back before `floor` (the oldest committed checkpoint, or the step it is at):
    whatever is older than floor - per_steps can never count again."""
    horizon = floor - cfg.budget.per_steps
    return [s for s in steps if s >= budget_from and s > horizon]
