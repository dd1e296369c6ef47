"""Pure views of a TrainingRun's RunCarry: what the `status` query shows and what the carry
keeps. Deterministic and I/O-free; imported by workflows/training_run.py in the sandbox."""

from __future__ import annotations

from activities.contracts import RunCarry
from spec import RunSpec, SpikeConfig
from workflows.operator import compose_windows
from workflows.policy import still_counted


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
            "pending_rollback": c.rewind,
            "segment_running": list(running) if running else None}


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
