"""Pure views and updates of a TrainingRun's RunCarry (workflows/carry.py): what the
`status` query shows, what the carry keeps, what a returned segment and an applied rollback
change in it.
Deterministic and I/O-free; imported by workflows/training_run.py in the sandbox."""

from __future__ import annotations

from typing import Any

from activities.contracts import TrainSegmentResult
from common.commands import Rollback
from spec import RunSpec, SpikeConfig
from spec.spikes import batch_bound
from workflows.carry import RunCarry
from workflows.escalation import ESCALATE_LOWER_LR, escalate, lower_lr_window, still_counted
from workflows.lr_windows import compose_windows
from workflows.operator_queue import operator_rollback


def status_view(spec: RunSpec | None, c: RunCarry, *, stage: str, evals: dict[int, float],
                running: tuple[int, int] | None) -> dict:
    """The `status` query's answer (`mainspring run status`)."""
    return {"run_id": spec.run_id if spec else "", "stage": stage,
            "durable": spec.storage.durable if spec else "", "step": c.next_step,
            "total_steps": spec.train.total_steps if spec else 0,
            "train_loss": c.train_loss, "stages_done": c.stages_done,
            "best_params": c.best_params, "workflow_runs": c.runs,
            "evals": {str(k): v for k, v in evals.items()},
            "needs_attention": c.hold.held["reason"] if c.hold.held else None,
            "rollback_steps": c.escalation.rollback_steps,
            "rollbacks_total": c.escalation.rollbacks_total,
            "lr_windows": c.escalation.lr_windows, "oldest_step": c.oldest_step,
            "early_stopped": c.early_stopped or None,
            "operator_queue": [q["name"] for q in c.operator.queue],
            "pending_rollback": (c.operator.pending_rollback.to_dict()
                                 if c.operator.pending_rollback else None),
            "segment_running": list(running) if running else None,
            # after OOMs: each micro-batch runs as this many chunks (workflows/adapt.py)
            "micro_split": c.micro_split,
            # after an oscillation: the gradient accumulation segments run with (0: spec's)
            "grad_accum": c.grad_accum,
            # multi-node runs (workflows/gang.py)
            "nodes_used": c.gang.nodes_used or (spec.train.nodes if spec else 1),
            "waiting_for_nodes": c.gang.waiting["reason"] if c.gang.waiting else None,
            "set_aside": dict(c.gang.set_aside),
            # steps between checkpoints now: the spec's, or the last choice for "auto"
            # (workflows/interval.py; 0 before the first), and the faults it counted
            "checkpoint_every": (c.interval.checkpoint_every if spec and spec.train.auto_checkpoint
                                 else spec.train.checkpoint_every if spec else 0),
            "faults_seen": c.interval.faults_seen}


def bounded(c: RunCarry, cfg: SpikeConfig) -> tuple[list[int], list[int], list[list[float]]]:
    """(rollback_steps, lowered_at, lr_windows) with only what can still matter: training
    never goes back before the oldest committed checkpoint (oldest_step, 0 until a segment
    reports one; or next_step, if a rollback went further), so no step up to there runs
    again and the rollback budget (escalate / rollback_allowance) counts nothing older
    than its window before it."""
    floor, e = min(c.oldest_step, c.next_step), c.escalation
    return (still_counted(e.rollback_steps, e.budget_from, floor, cfg),
            still_counted(e.lowered_at, e.budget_from, floor, cfg),
            compose_windows(e.lr_windows, floor))


def bound(c: RunCarry, cfg: SpikeConfig) -> None:
    """Drop from the carry what can no longer matter (bounded), so it stays small."""
    e = c.escalation
    e.rollback_steps, e.lowered_at, e.lr_windows = bounded(c, cfg)


def record_segment(c: RunCarry, seg: TrainSegmentResult) -> None:
    """A returned segment: where the run is now, what retention left, what it rolled back."""
    c.next_step, c.train_loss = seg.final_step, seg.train_loss
    c.segments_total += 1
    c.after_fault = None  # its recovery is recorded
    if seg.oldest_committed_step is not None:
        c.oldest_step = seg.oldest_committed_step
    if seg.stopped == "overfitting":
        c.early_stopped = "overfitting"  # the run ends after the escalation (it may hold)
    c.escalation.rollback_steps += [r["at_step"] for r in seg.rollbacks]
    c.escalation.rollbacks_total += len(seg.rollbacks)
    # what train.checkpoint_every "auto" is chosen from (workflows/interval.py): each
    # attempt after the first is a fault, and so is each restart in place
    c.interval.faults_seen += max(0, seg.attempt - 1) + seg.faults
    c.interval.checkpoint_stall_s += seg.checkpoint_stall_s
    c.interval.checkpoints_measured += seg.checkpoints
    c.interval.step_time_s = seg.step_time_s or c.interval.step_time_s


def raise_batch(c: RunCarry, s: RunSpec, seg: TrainSegmentResult) -> dict[str, Any] | None:
    """Pure but for the carry: a segment that stopped to ask for a larger gradient
    accumulation (a loss that shook while the gradient noise scale stood well above the
    batch, trainer/oscillation_watch.py) gets it from the next segment on, up to the run's
    one bound (spec/spikes.py batch_bound of `s`, the spec's own with the sweep's point
    applied: never of a raised accumulation); the data order is kept (each step reads more
    micro-batches). The batch_raised payload, or None when nothing changes: an ask at or
    under what runs already is refused (the trainer, told the same bound, asks for none)."""
    base, limit = s.train.grad_accum, run_batch_bound(s)
    now = c.grad_accum or base
    want = min(int(seg.grad_accum_asked or 0), limit)
    if want <= now:
        return None
    c.grad_accum = want
    return {"from_grad_accum": now, "to_grad_accum": want, "at_step": seg.final_step,
            "bound": limit,
            "why": "the loss shook while the gradient noise scale stood well above the batch "
                   "(the oscillation_detected event before it has the figures)"}


def run_batch_bound(s: RunSpec) -> int:
    """The most gradient accumulation an oscillation may raise `s` (the spec's own) to."""
    return batch_bound(s.train.grad_accum, s.spikes.oscillation)


def segment_spec(s: RunSpec, c: RunCarry) -> RunSpec:
    """The spec a segment runs: the sweep's point applied, and a raised accumulation with
    the run's bound beside it (spikes.oscillation.max_grad_accum), so the trainer bounds
    its asks by the spec's own accumulation, not by the raised one."""
    if not c.grad_accum:
        return s
    return s.replace(**{"train.grad_accum": c.grad_accum,
                        "spikes.oscillation.max_grad_accum": run_batch_bound(s)})


def apply_rollback(c: RunCarry, cmd: Rollback, command_id: str, pin: str) -> None:
    """An operator rollback applied at the step the run is at: the next segment starts at
    its target and applies it (operator_rollback), its pin released after that segment."""
    op = c.operator
    op.pending_rollback = operator_rollback(cmd, command_id, c.next_step, op.pending_rollback)
    op.rollback_pins += [pin] if pin else []
    c.next_step = min(c.next_step, cmd.to_step)


def escalation(c: RunCarry, cfg: SpikeConfig) -> tuple[str, str, list[int]]:
    """What the trainer's rollbacks since the last resume call for (escalation.escalate):
    (action, reason, the rollback steps counted). Lowering the LR goes into the carry."""
    e = c.escalation
    counted = [x for x in e.rollback_steps if x >= e.budget_from]
    action, reason = escalate(tuple(counted), c.next_step,
                              tuple(x for x in e.lowered_at if x >= e.budget_from), cfg)
    if action == ESCALATE_LOWER_LR:
        e.lowered_at.append(c.next_step)
        e.lr_windows.append(lower_lr_window(c.next_step, cfg))
    return action, reason, counted

