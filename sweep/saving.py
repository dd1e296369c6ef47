"""What pruning saved a sweep, from its records: the `pruning_saving` figure.

A sweep's records are its `sweep_trial` event payloads (workflows/sweep.py): each trial's
`steps` trained, `status` and `result` (held-out loss). Pruning is worth it when it saves a
good share of the trials' steps (target: at least 30 %) and the pruned sweep's winner is
still within 1 % of the loss an unpruned sweep of the same points finds. Pure, stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SAVING_TARGET = 0.30  # the share of trial steps pruning should save
LOSS_TOLERANCE = 0.01  # how far above the unpruned winner's loss the pruned one may be

Records = Sequence[Mapping[str, Any]]


def trained_steps(records: Records, trial_steps: int) -> int:
    """Steps the trials trained: each record's `steps`, a record without them the whole
    `trial_steps` (written before pruning existed, when every trial ran whole)."""
    return sum(int(r["steps"]) if isinstance(r.get("steps"), int) else trial_steps
               for r in records)


def pruning_saving(records: Records, trial_steps: int) -> float:
    """The share of the sweep's planned trial steps (trials x trial_steps) pruning saved:
    1 - trained / planned; 0.0 for no trials."""
    planned = len(records) * trial_steps
    return 1.0 - trained_steps(records, trial_steps) / planned if planned else 0.0


def winner_loss(records: Records) -> float | None:
    """The winning held-out loss: the lowest finite `result` of a trial not pruned."""
    losses = [float(r["result"]) for r in records
              if r.get("status", "complete") != "pruned"
              and isinstance(r.get("result"), (int, float)) and math.isfinite(r["result"])]
    return min(losses) if losses else None


@dataclass(frozen=True)
class PruningFigure:
    saving: float  # pruning_saving of the pruned sweep
    trained_steps: int
    planned_steps: int
    winner_loss: float | None  # the pruned sweep's winner
    reference_loss: float | None  # the unpruned sweep's winner
    trials_pruned: int

    @property
    def loss_gap(self) -> float | None:
        """How far the pruned winner's loss is above the unpruned one's, as a fraction."""
        if self.winner_loss is None or not self.reference_loss:
            return None
        return self.winner_loss / self.reference_loss - 1.0

    @property
    def meets_target(self) -> bool:
        gap = self.loss_gap
        return self.saving >= SAVING_TARGET and gap is not None and gap <= LOSS_TOLERANCE


def pruning_figure(pruned: Records, unpruned: Records, trial_steps: int) -> PruningFigure:
    """The figure for a pruned sweep against an unpruned one over the same trials."""
    return PruningFigure(
        saving=pruning_saving(pruned, trial_steps),
        trained_steps=trained_steps(pruned, trial_steps),
        planned_steps=len(pruned) * trial_steps, winner_loss=winner_loss(pruned),
        reference_loss=winner_loss(unpruned),
        trials_pruned=sum(1 for r in pruned if r.get("status") == "pruned"))
