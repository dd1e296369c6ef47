"""Pure views and updates of a TrainingRun's RunCarry: what the `status` query shows, what
the carry keeps, what a returned segment and an applied rollback change in it.
Deterministic and I/O-free; imported by workflows/training_run.py in the sandbox."""

from __future__ import annotations

from activities.contracts import Rollback, RunCarry, TrainSegmentResult
from spec import RunSpec, SpikeConfig
from workflows.operator import compose_windows, operator_rollback
from workflows.policy import ESCALATE_LOWER_LR, escalate, lower_lr_window, still_counted


def status_view(spec: RunSpec | None, c: RunCarry, *, stage: str, evals: dict[int, float],
                running: tuple[int, int] | None) -> dict:
    """The `status` query's answer (`mainspring run status`)."""
    return {"run_id": spec.run_id if spec else "", "stage": stage,
            "durable": spec.storage.durable if spec else "", "step": c.next_step,
            "total_steps": spec.train.total_steps if spec else 0,
            "train_loss": c.train_loss, "stages_done": c.stages_done,
            "best_params": c.best_params, "workflow_runs": c.runs,
            "evals": {str(k): v for k, v in evals.items()},
            "needs_attention": c.held["reason"] if c.held else None,
            "rollback_steps": c.rollback_steps, "rollbacks_total": c.rollbacks_total,
            "lr_windows": c.lr_windows, "oldest_step": c.oldest_step,
            "early_stopped": c.early_stopped or None,
            "operator_queue": [q["name"] for q in c.operator_queue],
            "pending_rollback": c.pending_rollback.to_dict() if c.pending_rollback else None,
            "segment_running": list(running) if running else None,
            # after OOMs: each micro-batch runs as this many chunks (workflows/adapt.py)
            "micro_split": c.micro_split,
            # multi-node runs (workflows/gang.py)
            "nodes_used": c.nodes_used or (spec.train.nodes if spec else 1),
            "waiting_for_nodes": c.waiting["reason"] if c.waiting else None,
            "set_aside": dict(c.set_aside),
            # steps between checkpoints now: the spec's, or the last choice for "auto"
            # (workflows/interval.py; 0 before the first), and the faults it counted
            "checkpoint_every": (c.checkpoint_every if spec and spec.train.auto_checkpoint
                                 else spec.train.checkpoint_every if spec else 0),
            "faults_seen": c.faults_seen}


def bounded(c: RunCarry, cfg: SpikeConfig) -> tuple[list[int], list[int], list[list[float]]]:
    """(rollback_steps, lowered_at, lr_windows) with only what can still matter: training
    never goes back before the oldest committed checkpoint (oldest_step, 0 until a segment
    reports one; or next_step, if a rollback went further), so no step up to there runs
    again and the rollback budget (escalate / rollback_allowance) counts nothing older
    than its window before it."""
    floor = min(c.oldest_step, c.next_step)
    return (still_counted(c.rollback_steps, c.budget_from, floor, cfg),
            still_counted(c.lowered_at, c.budget_from, floor, cfg),
            compose_windows(c.lr_windows, floor))


def bound(c: RunCarry, cfg: SpikeConfig) -> None:
    """Drop from the carry what can no longer matter (bounded), so it stays small."""
    c.rollback_steps, c.lowered_at, c.lr_windows = bounded(c, cfg)


def record_segment(c: RunCarry, seg: TrainSegmentResult) -> None:
    """A returned segment: where the run is now, what retention left, what it rolled back."""
    c.next_step, c.train_loss = seg.final_step, seg.train_loss
    c.segments_total += 1
    c.after_fault = None  # its recovery is recorded
    if seg.oldest_committed_step is not None:
        c.oldest_step = seg.oldest_committed_step
    if seg.stopped == "overfitting":
        c.early_stopped = "overfitting"  # the run ends after the escalation (it may hold)
    c.rollback_steps += [r["at_step"] for r in seg.rollbacks]
    c.rollbacks_total += len(seg.rollbacks)
    # what train.checkpoint_every "auto" is chosen from (workflows/interval.py): each
    # attempt after the first is a fault, and so is each restart in place
    c.faults_seen += max(0, seg.attempt - 1) + seg.faults
    c.checkpoint_stall_s += seg.checkpoint_stall_s
    c.checkpoints_measured += seg.checkpoints
    c.step_time_s = seg.step_time_s or c.step_time_s


def apply_rollback(c: RunCarry, cmd: Rollback, command_id: str, pin: str) -> None:
    """An operator rollback applied at the step the run is at: the next segment starts at
    its target and applies it (operator_rollback), its pin released after that segment."""
    c.pending_rollback = operator_rollback(cmd, command_id, c.next_step, c.pending_rollback)
    c.rollback_pins += [pin] if pin else []
    c.next_step = min(c.next_step, cmd.to_step)


def escalation(c: RunCarry, cfg: SpikeConfig) -> tuple[str, str, list[int]]:
    """What the trainer's rollbacks since the last resume call for (policy.escalate):
    (action, reason, the rollback steps counted). Lowering the LR goes into the carry."""
    counted = [x for x in c.rollback_steps if x >= c.budget_from]
    action, reason = escalate(tuple(counted), c.next_step,
                              tuple(x for x in c.lowered_at if x >= c.budget_from), cfg)
    if action == ESCALATE_LOWER_LR:
        c.lowered_at.append(c.next_step)
        c.lr_windows.append(lower_lr_window(c.next_step, cfg))
    return action, reason, counted

