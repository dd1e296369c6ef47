"""The step loop's spike handling and online evaluation (issue 6, DESIGN §3).

The decisions are pure (trainer/spikes.py); this module applies them to the live engine
and records every one with its evidence:

- `skip`: the update of this step is vetoed (trainer/optim.py): weights, Adam moments and
  step counts stay as if the batch were never seen. The step counter and the LR schedule
  still advance (the schedule is a function of the step, so the run ends on its planned
  step and token budget; docs/decisions.md). Events `loss_spike` + `batch_skipped`.
- `rollback`: uncommit checkpoints from the spike's onset on, restore the newest committed
  checkpoint before the onset, add the data window around the onset to the skip ranges
  (doubled when the region already had one), reset the detector's outlier window and
  continue. Events `loss_spike` + `rollback`, flushed at once. More rollbacks in this
  segment than the workflow allows end the segment early so the workflow can escalate.
- online evaluation every `train.eval_every` steps; `overfitting` when validation rises while
  training loss falls for `train.overfit_evals` evaluations in a row.

Every rank runs the same code on the same all-reduced loss, so verdicts agree across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import structlog
import torch

from common.errors import Diverged
from storage.events import read_events
from trainer.checkpointing import Run, rollback_to
from trainer.data import cursor_after
from trainer.evaluate import evaluate_model
from trainer.spikes import (
    Verdict,
    merge_ranges,
    observe,
    overfitting,
    reset_window,
    skip_range,
    times_in_region,
)
from trainer.state import TrainState

log = structlog.get_logger(__name__)

EVALS_KEPT = 32  # online evaluations kept in the TrainState (the overfitting test needs k+1)
RECENT_LOSSES = 10  # the segment's reported training loss: mean of the last accepted ones


def loss_scale_verdict(step: int, loss: float, scale: float | None, min_scale: float,
                       overflowed: bool) -> Verdict | None:
    """fp16: an overflow at the minimum loss scale cannot be scaled away: a sustained spike."""
    if scale is None or not overflowed or scale > min_scale:
        return None
    return Verdict(action="rollback", step=step, loss=loss, reason="loss_scale_at_minimum",
                   onset=step, evidence={"loss_scale": scale, "min_loss_scale": min_scale})


@dataclass
class SegmentOutcome:
    """What the segment reports about spikes and evaluation (result.json)."""

    rollbacks: list[dict] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    overflow_steps: int = 0
    evals: list[list[float]] = field(default_factory=list)
    stopped: str = ""  # "" | rollback_budget | overfitting | interrupted (trainer/segment.py)


class SpikeGuard:
    def __init__(self, run: Run, engine, val: list[tuple[torch.Tensor, torch.Tensor]] | None,
                 max_rollbacks: int) -> None:
        self.run, self.engine, self.val = run, engine, val
        self.cfg, self.train_cfg = run.spec.spikes, run.spec.train
        self.per_step = run.spec.train.grad_accum
        self.max_rollbacks = max_rollbacks  # < 0: unlimited
        self.cursors: dict[int, int] = {}  # step -> data cursor its first batch was read at
        self.train_losses: list[float] = []  # accepted losses since the last online evaluation
        self.recent: list[float] = []  # last accepted losses (the segment's reported loss)
        self.outcome = SegmentOutcome()

    # ---- per step ------------------------------------------------------------------
    def judge(self, state: TrainState, step: int, loss: float, cursor: int) -> Verdict:
        """Detector verdict for `step` (1-based), before its update; vetoes the update unless ok."""
        self.cursors[step] = cursor
        self.cursors.pop(step - self.cfg.window, None)  # an onset is inside the window
        if not self.cfg.enabled:
            return Verdict(action="ok", step=step, loss=loss, reason="handling_off")
        state.detector, verdict = observe(state.detector, step, loss, self.cfg)
        if verdict.action != "ok":
            self.engine.basic_optimizer.veto = True
            self._event("loss_spike", step, f"loss_spike/{step}", **evidence(verdict))
        if verdict.action == "skip":
            state.skipped.append(step)
            self.outcome.skipped_steps.append(step)
            self._event("batch_skipped", step, f"batch_skipped/{step}", reason=verdict.reason,
                        batches=[cursor, cursor + self.per_step], loss=finite_or_none(loss))
        return verdict

    def after_step(self, step: int, loss: float, verdict: Verdict) -> Verdict:
        """After engine.step(): count fp16 overflow skips; one at the minimum scale is a
        sustained spike (rollback verdict). Keeps accepted losses for online eval."""
        if verdict.action == "ok" and math.isfinite(loss):
            self.train_losses.append(loss)
            self.recent = (self.recent + [loss])[-RECENT_LOSSES:]
        if self.train_cfg.precision != "fp16" or self.engine.was_step_applied():
            return verdict
        self.outcome.overflow_steps += 1
        scaled = loss_scale_verdict(step, loss, getattr(self.engine.optimizer, "cur_scale", None),
                                    self.train_cfg.fp16_min_loss_scale, overflowed=True)
        if scaled is None or not self.cfg.enabled:
            return verdict
        self._event("loss_spike", step, f"loss_spike/{step}", **evidence(scaled))
        return scaled

    def recent_loss(self) -> float | None:
        """Mean of the last RECENT_LOSSES accepted training losses (None if there are none)."""
        return sum(self.recent) / len(self.recent) if self.recent else None

    # ---- rollback --------------------------------------------------------------------
    def rollback(self, state: TrainState, verdict: Verdict) -> TrainState:
        """Restore the newest checkpoint before the onset; skip the data around it."""
        run, onset = self.run, verdict.onset or verdict.step
        onset_cursor = self.cursors.get(onset, state.data_cursor)
        # The onset's loss was computed with the weights after update onset-1, which may be
        # the bad one (an LR burst shows only in the next loss): go back before it too.
        before = max(0, onset - 2)
        # Restore first, uncommit the abandoned trajectory only once the target has loaded:
        # with no checkpoint left before the onset nothing is deleted (issue 11).
        restored, gone = rollback_to(run, self.engine, before)
        if restored is None:
            raise Diverged(verdict.step, f"no committed checkpoint at or before step {before} "
                                         f"(before the spike's onset at step {onset}) to roll "
                                         f"back to; every checkpoint is kept")
        ranges = merge_ranges(list(state.skip_ranges) + list(restored.skip_ranges))
        times = times_in_region(ranges, onset_cursor, self.cfg, self.per_step)
        window = skip_range(onset_cursor, self.cfg, times, self.per_step)
        restored.skip_ranges = merge_ranges(ranges + [window])
        restored.detector = reset_window(restored.detector)
        record = {"at_step": verdict.step, "onset": onset, "to_step": restored.step,
                  "skip": list(window), "times_in_region": times, "discarded": gone}
        self.outcome.rollbacks.append(record)
        self._event("rollback", verdict.step, f"rollback/{verdict.step}/{onset}/{restored.step}",
                    **record, lost_steps=verdict.step - restored.step, **evidence(verdict))
        log.warning("rollback", **record)
        if 0 <= self.max_rollbacks < len(self.outcome.rollbacks):
            self.outcome.stopped = "rollback_budget"
        return restored

    # ---- online evaluation -------------------------------------------------------------
    def maybe_evaluate(self, state: TrainState) -> None:
        every = self.train_cfg.eval_every
        if not every or self.val is None or state.step % every:
            return
        val = self.run.mean_over_ranks(torch.tensor(evaluate_model(self.engine.module, self.val)))
        train = sum(self.train_losses) / len(self.train_losses) if self.train_losses else math.nan
        self.train_losses = []
        state.evals = (state.evals + [[state.step, train, val]])[-EVALS_KEPT:]
        self.outcome.evals.append([state.step, train, val])
        self.run.progress.write("eval", step=state.step, val_loss=val, train_loss=train)
        self._event("eval", state.step, f"eval/{state.step}", val_loss=val,
                    train_loss=finite_or_none(train))
        k = self.train_cfg.overfit_evals
        if overfitting(state.evals, k):
            tail = state.evals[-(k + 1):]
            self._event("overfitting", state.step, f"overfitting/{state.step}", evals=tail,
                        early_stop=self.train_cfg.early_stop_on_overfit,
                        evidence=f"validation loss rose {k} evaluations in a row "
                                 f"({tail[0][2]:.4f} -> {tail[-1][2]:.4f}) while training loss "
                                 f"fell ({tail[0][1]:.4f} -> {tail[-1][1]:.4f})")
            if self.train_cfg.early_stop_on_overfit:
                self.outcome.stopped = "overfitting"

    def _event(self, kind: str, step: int, event_id: str, **payload) -> None:
        if self.run.events is None:
            return
        # A replay after a rollback passes the same step numbers again: its events are new.
        event_id += f"/a{self.run.args.attempt}r{len(self.outcome.rollbacks)}"
        self.run.events.emit(kind, step=step, event_id=event_id, **payload)
        if kind in ("rollback", "overfitting"):
            self.run.events.flush()  # every recovery decision is durable at once


def recorded_skip_ranges(run: Run) -> list[tuple[int, int]]:
    """The skip window of every rollback in the run's event log (flushed at each decision).

    A rollback restores a checkpoint committed *before* it decided the window, so until the
    next commit the window lives only in memory: a segment that ends at the restored step
    (rollback budget spent) or dies before its next commit would replay the bad data. The
    restored TrainState is merged with these, read by rank 0 and broadcast.
    """
    events = run.from_rank0(lambda: read_events(run.spec.storage.durable, run.spec.run_id,
                                                kinds=("rollback",)))
    return [(int(e["payload"]["skip"][0]), int(e["payload"]["skip"][1]))
            for e in events if e["payload"].get("skip")]


# ---- an operator's rollback (the workflow's `rollback` update) ---------------------------
def pending_rewind(run: Run, rewind: dict | None) -> dict | None:
    """The operator rollback this segment must apply first: None when there is none, or when
    an earlier attempt of this segment applied it already (its event is in the log)."""
    if not rewind:
        return None
    event_id = operator_rollback_id(rewind)
    done = run.from_rank0(lambda: any(
        e["event_id"] == event_id for e in read_events(
            run.spec.storage.durable, run.spec.run_id, kinds=("rollback", "rollback_refused"))))
    return None if done else rewind


def refuse_rewind(run: Run, rewind: dict, oldest: int | None) -> None:
    """No checkpoint at or before the operator's target is left (retention removed it after
    the command was admitted): nothing was deleted; say so once (a retry reads this event)."""
    record = {"by": "operator", "to_step": int(rewind["to_step"]), "oldest_step": oldest,
              "note": rewind.get("note", ""), "who": rewind.get("who", ""),
              "reason": f"no committed checkpoint at or before step {rewind['to_step']} is "
                        f"left; the oldest is {oldest}"}
    log.warning("operator_rollback_refused", **record)
    if run.events is not None:
        run.events.emit("rollback_refused", step=int(rewind["through_step"]),
                        event_id=operator_rollback_id(rewind), **record)
        run.events.flush()


def operator_rollback_id(rewind: dict) -> str:
    return f"operator_rollback/{rewind['id']}"


def apply_rewind(run: Run, state: TrainState, rewind: dict, discarded: list[int]) -> None:
    """After restoring the newest checkpoint at or before `to_step`: with `skip_data`, add
    the data the abandoned steps read (up to `through_step`) to the skip ranges, then record
    the decision (a `rollback` event by the operator, flushed so a retry does not redo it)."""
    through, window = int(rewind["through_step"]), None
    if rewind.get("skip_data") and through > state.step:
        per_step = run.spec.train.grad_accum
        end = cursor_after(state.data_cursor, (through - state.step) * per_step,
                           state.skip_ranges)
        window = (state.data_cursor, end)
        state.skip_ranges = merge_ranges(list(state.skip_ranges) + [window])
    record = {"by": "operator", "at_step": through, "to_step": state.step,
              "skip": list(window) if window else None, "discarded": discarded,
              "lost_steps": max(0, through - state.step), "note": rewind.get("note", ""),
              "who": rewind.get("who", "")}
    log.warning("operator_rollback", **record)
    if run.events is not None:
        run.events.emit("rollback", step=through, event_id=operator_rollback_id(rewind), **record)
        run.events.flush()


def evidence(v: Verdict) -> dict:
    return {"loss": finite_or_none(v.loss), "baseline": v.baseline, "spread": v.spread,
            "threshold": v.threshold, "reason": v.reason, **v.evidence}


def finite_or_none(x: float | None) -> float | None:
    """JSON has no NaN: a non-finite loss is reported as null."""
    return x if x is not None and math.isfinite(x) else None
