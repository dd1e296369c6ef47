"""Online evaluation every `train.eval_every` steps, and the overfitting check: validation
loss rising while training loss falls for `train.overfit_evals` evaluations in a row
(an `overfitting` event; with `train.early_stop_on_overfit` the segment stops there:
trainer/stopping.py decides it from the `Evaluation` returned)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.protocol import EvalLine, SegmentOutcome
from trainer import tracing
from trainer.context import SegmentContext
from trainer.evaluate import evaluate_model
from trainer.guard import SpikeGuard, decision_event, finite_or_none
from trainer.pipeline import evaluate_pipeline, is_pipeline
from trainer.spikes import overfitting
from trainer.state import TrainState

EVALS_KEPT = 32  # online evaluations kept in the TrainState (the overfitting test needs k+1)


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """One online evaluation: the mean training loss accepted since the last one, the mean
    validation loss over ranks, and whether the run is overfitting."""

    step: int
    train_loss: float  # nan when no loss was accepted since the last evaluation
    val_loss: float
    overfitting: bool = False


class OnlineEval:
    def __init__(self, ctx: SegmentContext, engine, val: list[tuple[torch.Tensor, torch.Tensor]]
                 | None, spikes: SpikeGuard, outcome: SegmentOutcome) -> None:
        self.ctx, self.engine, self.val, self.spikes = ctx, engine, val, spikes
        self.cfg, self.outcome = ctx.spec.train, outcome

    def maybe_evaluate(self, state: TrainState, rolled_back: bool = False) -> Evaluation | None:
        """Evaluate every `train.eval_every` steps (every rank: the mean is a collective).
        Not after a rollback: the state is the restored one, evaluated when first trained."""
        every = self.cfg.eval_every
        if not every or self.val is None or state.step % every or rolled_back:
            return None
        with tracing.span("online_eval", badput="evaluation", step=state.step, rank=self.ctx.rank):
            # host sync: every batch's loss (a pipeline's: through its stages, trainer/pipeline.py)
            mine = (evaluate_pipeline(self.engine, self.val) if is_pipeline(self.engine)
                    else evaluate_model(self.engine.module, self.val))
            # collective: the mean validation loss over ranks
            val = self.ctx.mean_over_ranks(torch.tensor(mine))
        taken, self.spikes.accepted = self.spikes.accepted, []
        train = sum(taken) / len(taken) if taken else math.nan
        state.evals = (state.evals + [[state.step, train, val]])[-EVALS_KEPT:]
        self.outcome.evals.append([state.step, train, val])
        self.ctx.progress.write(EvalLine(step=state.step, val_loss=val, train_loss=train))
        self._event("eval", state.step, f"eval/{state.step}", val_loss=val,
                    train_loss=finite_or_none(train))
        k = self.cfg.overfit_evals
        found = overfitting(state.evals, k)
        if found:
            tail = state.evals[-(k + 1):]
            self._event("overfitting", state.step, f"overfitting/{state.step}", evals=tail,
                        early_stop=self.cfg.early_stop_on_overfit,
                        evidence=f"validation loss rose {k} evaluations in a row "
                                 f"({tail[0][2]:.4f} -> {tail[-1][2]:.4f}) while training loss "
                                 f"fell ({tail[0][1]:.4f} -> {tail[-1][1]:.4f})")
        return Evaluation(step=state.step, train_loss=train, val_loss=val, overfitting=found)

    def _event(self, kind: str, step: int, event_id: str, **payload) -> None:
        decision_event(self.ctx, self.outcome, kind, step, event_id, **payload)
