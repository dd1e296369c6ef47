"""Operator commands on a TrainingRun (DESIGN §6): parsing and admission, pure and I/O-free.

The workflow's updates (`pause`, `resume`, `rollback`, `set_lr_scale`) and its `abort` signal
take one JSON object, so the Temporal CLI and UI can send them as well as `mainspring run`:

    pause         {"reason"}                              stop the segment at its next step
                                                          (checkpoint), wait for `resume`
    resume        {"note"}                                continue a paused run
    rollback      {"to_step", "skip_data": true, "note"}  restore the newest checkpoint at or
                                                          before to_step; skip the data the
                                                          abandoned steps read
    set_lr_scale  {"scale", "steps": 0, "note"}           multiply the scheduled LR by scale
                                                          from now for `steps` steps (0: to
                                                          the end)
    abort         {"reason"}                              stop at a checkpoint and end the run

Every object may carry "who" (recorded in the `operator` event). A refused command raises in
the update's validator, so it leaves no trace in the workflow history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

COMMANDS = ("pause", "resume", "rollback", "set_lr_scale", "abort")
TRAINING_STAGES = ("starting", "prepare_data", "warmup_sweep", "train", "paused",
                   "needs_attention")
HELD_STAGES = ("paused", "needs_attention")
MAX_LR_SCALE = 10.0


class Refused(ValueError):
    """An operator command that cannot be accepted now; the message says why and what to do."""


@dataclass(frozen=True)
class Command:
    name: str
    who: str = ""
    note: str = ""
    to_step: int = 0
    skip_data: bool = True
    scale: float = 1.0
    steps: int = 0
    args: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "who": self.who, "note": self.note, "args": self.args}


def parse_command(name: str, raw: Any) -> Command:
    """A command from its update/signal input: a JSON object, or a bare string as the
    reason/note. Raises Refused naming the bad field."""
    if name not in COMMANDS:
        raise Refused(f"unknown command {name!r}; use one of {', '.join(COMMANDS)}")
    if raw is None or isinstance(raw, str):
        raw = {"note": raw or ""}
    if not isinstance(raw, dict):
        raise Refused(f"{name}: expected a JSON object, got {type(raw).__name__}")
    known = {"who", "note", "reason", "to_step", "skip_data", "scale", "steps"}
    if unknown := sorted(set(raw) - known):
        raise Refused(f"{name}: unknown field(s) {unknown}; known: {sorted(known)}")
    note = str(raw.get("note") or raw.get("reason") or "")
    cmd = Command(name=name, who=str(raw.get("who") or ""), note=note, args=dict(raw))
    if name == "rollback":
        if "to_step" not in raw:
            raise Refused("rollback: to_step is required (the step to go back to)")
        to_step = raw["to_step"]
        if isinstance(to_step, bool) or not isinstance(to_step, int) or to_step < 0:
            raise Refused(f"rollback: to_step must be an integer >= 0, got {to_step!r}")
        skip = raw.get("skip_data", True)
        if not isinstance(skip, bool):
            raise Refused(f"rollback: skip_data must be true or false, got {skip!r}")
        return Command(**{**cmd.__dict__, "to_step": to_step, "skip_data": skip})
    if name == "set_lr_scale":
        scale, steps = raw.get("scale"), raw.get("steps", 0)
        if isinstance(scale, bool) or not isinstance(scale, int | float) \
                or not math.isfinite(scale) or not 0 < scale <= MAX_LR_SCALE:
            raise Refused(f"set_lr_scale: scale must be a number in (0, {MAX_LR_SCALE:g}], "
                          f"got {scale!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise Refused(f"set_lr_scale: steps must be an integer >= 0 (0: to the end of "
                          f"the run), got {steps!r}")
        return Command(**{**cmd.__dict__, "scale": float(scale), "steps": steps})
    return cmd


def admit(cmd: Command, *, stage: str, step: int, total_steps: int,
          queued: tuple[str, ...]) -> str:
    """Why `cmd` is refused now ('' when admitted). `queued`: names of commands accepted
    but not yet applied (they apply at the next step boundary of training)."""
    if stage in ("completed", "aborted", "failed"):
        return f"the run has ended (stage {stage!r})"
    if "abort" in queued:
        return "the run is being aborted"
    if cmd.name == "abort":
        return ""
    if stage not in TRAINING_STAGES or step >= total_steps:
        return f"training is over (stage {stage!r}, step {step}); only abort applies now"
    if cmd.name == "resume":
        if stage not in HELD_STAGES:
            return f"run is not paused (stage {stage!r}); nothing to resume"
        return ""
    if cmd.name == "pause" and (stage in HELD_STAGES or "pause" in queued):
        return f"run is already paused (stage {stage!r})" if stage in HELD_STAGES \
            else "a pause is already on its way"
    if cmd.name == "rollback" and cmd.to_step >= step:
        return (f"rollback to step {cmd.to_step} is not before the run's step {step}; "
                f"pick a step < {step}" if step else "nothing has been trained yet")
    return ""


def lr_window(cmd: Command, step: int, total_steps: int) -> list[float]:
    """set_lr_scale as an LR window [start, end, factor] (steps in (start, end])."""
    end = min(step + cmd.steps, total_steps) if cmd.steps else total_steps
    return [step, end, cmd.scale]


def rewind(cmd: Command, command_id: str, step: int, pending: dict | None) -> dict:
    """The trainer's --rewind for an applied rollback: the abandoned steps run to the
    furthest step reached, also across a rollback not yet applied by a segment."""
    through = max(step, int(pending["through_step"]) if pending else 0)
    return {"id": command_id, "to_step": cmd.to_step, "through_step": through,
            "skip_data": cmd.skip_data, "note": cmd.note, "who": cmd.who}
