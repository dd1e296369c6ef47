"""What the Temporal Web UI and CLI show of a TrainingRun with no mainspring CLI.

- **Memo**: the run's headline as flat keys — `stage`, `step`, `total_steps`, `loss`,
  `faults_recovered`, `rollbacks`, `durable` and a one-line `headline` — upserted when it
  changes: at each stage change, hold and resume, segment boundary and at the end
  (`temporal workflow describe`, the UI's Memo). One upsert is one history event, so it is
  never sent unchanged. Continue-as-new passes it on (a new run starts with no memo of its
  own). Histories from before it replay without it (MEMO_PATCH).
- **Current details** (`workflow.set_current_details`; the UI's "Current Details",
  `temporal workflow metadata`): the same headline in Markdown with what is running now
  and what to do about a hold. Not a command: set freely, nothing in the history.
- The static summary is the starter's (`mainspring run start` sets it from
  spec/summary.py); each activity carries its own summary (workflows/stages.py,
  workflows/sweep.py), so the UI's timeline reads as the run's story.

Workflow code: deterministic, no I/O; `memo`, `line` and `details` are pure.
"""

from __future__ import annotations

import math
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spec import RunSpec
    from workflows.carry import RunCarry

MEMO_PATCH = "headline_memo"  # workflow.patched id of the memo upserts


def line(stage: str, step: int, total_steps: int, loss: float | None, faults: int) -> str:
    """The one-line headline: `train · step 80/160 · loss 3.2100 · 1 fault recovered`."""
    parts = [stage, f"step {step}/{total_steps}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    parts.append(f"{faults} fault{'' if faults == 1 else 's'} recovered")
    return " · ".join(parts)


def memo(spec: RunSpec, c: RunCarry, stage: str) -> dict[str, Any]:
    """The memo's keys. `loss` is the last segment's training loss (None before one, or
    when not finite: JSON has no NaN); `faults_recovered` counts the faults the run went on
    from (RunCarry.faults_seen: retried attempts, restarts in place, adapted failures,
    failed gang launches)."""
    loss = c.train_loss if c.train_loss is not None and math.isfinite(c.train_loss) else None
    loss = round(loss, 4) if loss is not None else None
    total = spec.train.total_steps
    return {"stage": stage, "step": c.next_step, "total_steps": total, "loss": loss,
            "faults_recovered": c.interval.faults_seen, "rollbacks": c.escalation.rollbacks_total,
            "durable": spec.storage.durable,
            "headline": line(stage, c.next_step, total, loss, c.interval.faults_seen)}


def details(spec: RunSpec, c: RunCarry, stage: str, running: tuple[int, int] | None) -> str:
    """The current details, Temporal Markdown: the headline, what runs now, a hold's reason
    and the command that ends it, where the run's record is."""
    m = memo(spec, c, stage)
    out = [f"**{spec.run_id}** · {m['headline']} · {c.escalation.rollbacks_total} rollbacks"]
    if running:
        out.append(f"training steps {running[0]}–{running[1]}")
    if c.hold.held:
        out.append(f"held ({c.hold.held['stage']}): {c.hold.held['reason']} — continue with "
                   f"`temporal workflow update execute --workflow-id {spec.run_id} "
                   "--name resume` or `mainspring run resume`")
    if c.gang.waiting:
        out.append(f"waiting for nodes: {c.gang.waiting['reason']}")
    if c.stages_done:
        out.append("stages done: " + ", ".join(c.stages_done))
    out.append(f"events: `mainspring events {spec.run_id} --durable {spec.storage.durable}`")
    return "\n\n".join(out)


class Headline:
    """Shows the headline: the current details always, the memo when it changed."""

    def __init__(self) -> None:
        self._shown: dict[str, Any] | None = None

    def show(self, spec: RunSpec | None, c: RunCarry, stage: str,
             running: tuple[int, int] | None = None) -> None:
        if spec is None:
            return
        workflow.set_current_details(details(spec, c, stage, running))
        now = memo(spec, c, stage)
        if self._shown is None:  # a continued run starts with the memo its last run left
            self._shown = {k: workflow.memo_value(k, None) for k in now}
        if now != self._shown and workflow.patched(MEMO_PATCH):
            workflow.upsert_memo(now)
            self._shown = now

    def carried(self) -> dict[str, Any] | None:
        """The memo to continue as new with (a continued run starts with none of its own),
        or None while nothing was shown (histories from before the memo)."""
        shown = self._shown or {}
        return dict(shown) if any(v is not None for v in shown.values()) else None
