"""Online evaluation every `train.eval_every` steps, and the overfitting check: validation
loss rising while training loss falls for `train.overfit_evals` evaluations in a row
(an `overfitting` event; with `train.early_stop_on_overfit` the segment stops there)."""

from __future__ import annotations

import math

import torch

from common.protocol import EvalLine, SegmentOutcome
from trainer import tracing
from trainer.context import SegmentContext
from trainer.evaluate import evaluate_model
from trainer.guard import SpikeGuard, decision_event, finite_or_none
from trainer.spikes import overfitting
from trainer.state import TrainState

EVALS_KEPT = 32  # online evaluations kept in the TrainState (the overfitting test needs k+1)


class OnlineEval:
    def __init__(self, ctx: SegmentContext, engine, val: list[tuple[torch.Tensor, torch.Tensor]]
                 | None, spikes: SpikeGuard, outcome: SegmentOutcome) -> None:
        self.ctx, self.engine, self.val, self.spikes = ctx, engine, val, spikes
        self.cfg, self.outcome = ctx.spec.train, outcome

    def maybe_evaluate(self, state: TrainState) -> None:
        every = self.cfg.eval_every
        if not every or self.val is None or state.step % every:
            return
        with tracing.span("online_eval", badput="evaluation", step=state.step, rank=self.ctx.rank):
            val = self.ctx.mean_over_ranks(torch.tensor(evaluate_model(self.engine.module,
                                                                       self.val)))
        taken, self.spikes.accepted = self.spikes.accepted, []
        train = sum(taken) / len(taken) if taken else math.nan
        state.evals = (state.evals + [[state.step, train, val]])[-EVALS_KEPT:]
        self.outcome.evals.append([state.step, train, val])
        self.ctx.progress.write(EvalLine(step=state.step, val_loss=val, train_loss=train))
        self._event("eval", state.step, f"eval/{state.step}", val_loss=val,
                    train_loss=finite_or_none(train))
        k = self.cfg.overfit_evals
        if overfitting(state.evals, k):
            tail = state.evals[-(k + 1):]
            self._event("overfitting", state.step, f"overfitting/{state.step}", evals=tail,
                        early_stop=self.cfg.early_stop_on_overfit,
                        evidence=f"validation loss rose {k} evaluations in a row "
                                 f"({tail[0][2]:.4f} -> {tail[-1][2]:.4f}) while training loss "
                                 f"fell ({tail[0][1]:.4f} -> {tail[-1][1]:.4f})")
            if self.cfg.early_stop_on_overfit:
                self.outcome.stopped = "overfitting"

    def _event(self, kind: str, step: int, event_id: str, **payload) -> None:
        decision_event(self.ctx, self.outcome, kind, step, event_id, **payload)
