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

Floods coalesce and stay bounded (issue 11, item 12):
- Commands accepted while a segment runs wait in one queue and all apply at the step the
  segment stops at: the segment is cancelled once per boundary, however many arrive, and
  ones that arrive while the queue is being applied join that boundary. At most
  MAX_QUEUED wait; more are refused ("N commands already waiting; wait until they apply").
  `abort` is never refused for that, and `resume` does not queue.
- pause: a second one while one is queued, or while the run is held, is refused (two
  pauses are one).
- set_lr_scale: every accepted command multiplies — also two at the same boundary (same
  start step): the LR the run gets never depends on whether a boundary happened to fall
  between two commands. The windows are kept as disjoint pieces with the factors of
  overlapping windows multiplied (compose_windows); a command adds at most two pieces, and
  one that could take the schedule past MAX_LR_WINDOWS pieces is refused.
- rollback: several at one boundary go to the earliest target and skip the data through the
  furthest step reached (rewind); the later ones with a target at or after the step the
  first one went to are recorded as not applied. A target before the oldest checkpoint
  retention left (oldest_step) is refused.
- A held run continues as new after UPDATES_PER_RUN accepted updates (or when Temporal
  suggests it), so `resume` is never refused for Temporal's per-run limits.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

COMMANDS = ("pause", "resume", "rollback", "set_lr_scale", "abort")
TRAINING_STAGES = ("starting", "prepare_data", "warmup_sweep", "train", "paused",
                   "needs_attention")
HELD_STAGES = ("paused", "needs_attention")
MAX_LR_SCALE = 10.0
# Bounds for a command flood. Temporal refuses updates beyond 10 in flight and 2000 per
# workflow run (server dynamic config history.maxInFlightUpdates / history.maxTotalUpdates)
# and suggests continue-as-new at 4 Ki history events; one held-run command costs about six
# events (workflow task, update accepted/completed, the operator event's marker).
MAX_QUEUED = 32  # accepted, not yet applied: far more than a human sends in one stop
MAX_LR_WINDOWS = 256  # LR pieces in the carry and the trainer's --lr-windows-file
UPDATES_PER_RUN = 200  # a held run continues as new after accepting this many updates


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
          queued: tuple[str, ...], oldest_step: int = 0, lr_windows: int = 0) -> str:
    """Why `cmd` is refused now ('' when admitted). `queued`: names of commands accepted
    but not yet applied (they apply at the next step boundary of training); `oldest_step`:
    the oldest committed checkpoint retention left; `lr_windows`: live LR pieces."""
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
    if len(queued) >= MAX_QUEUED:
        return f"{len(queued)} commands already waiting; wait until they apply"
    if cmd.name == "rollback" and cmd.to_step >= step:
        return (f"rollback to step {cmd.to_step} is not before the run's step {step}; "
                f"pick a step < {step}" if step else "nothing has been trained yet")
    if cmd.name == "rollback" and cmd.to_step < oldest_step:
        return (f"rollback to step {cmd.to_step}: no checkpoint at or before it is left "
                f"(retention keeps steps >= {oldest_step}); the oldest step you can roll "
                f"back to is {oldest_step}")
    waiting = queued.count("set_lr_scale")
    if cmd.name == "set_lr_scale" and lr_windows + 2 * (waiting + 1) > MAX_LR_WINDOWS:
        return (f"set_lr_scale: the LR schedule has {lr_windows} windows"
                + (f" and {waiting} set_lr_scale command(s) waiting" if waiting else "")
                + f"; it holds at most {MAX_LR_WINDOWS} (a command adds up to 2). A window "
                  "is dropped once no rollback can reach it (retention removed every "
                  "checkpoint before its end); until then send fewer, longer changes")
    return ""


def not_applied(cmd: Command, step: int) -> str:
    """Why an accepted command does nothing at the boundary ('' when it applies): a rollback
    was admitted against the running segment's end, and the run stopped before its target."""
    if cmd.name == "rollback" and cmd.to_step >= step:
        return f"the run stopped at step {step}, not after step {cmd.to_step}"
    return ""


def lr_window(cmd: Command, step: int, total_steps: int) -> list[float]:
    """set_lr_scale as an LR window [start, end, factor] (steps in (start, end])."""
    end = min(step + cmd.steps, total_steps) if cmd.steps else total_steps
    return [step, end, cmd.scale]


def compose_windows(windows: list[list[float]], floor: int = 0) -> list[list[float]]:
    """The LR multipliers of `windows` ([start, end, factor]: steps in (start, end], the
    factors of overlapping windows multiply — trainer/segment.py:lr_scale) as contiguous
    disjoint pieces, in step order, with the same factor at every step after `floor`.

    Adjacent pieces with equal factors merge; a x1 gap between windows is a piece of its
    own (so a new window adds at most two pieces: MAX_LR_WINDOWS bounds the count exactly);
    x1 at either end and pieces ending at or before `floor` — the oldest step training can
    go back to (no checkpoint before it is left, so no step up to it runs again) — are
    dropped. Deterministic and O(pieces x windows): cheap for a bounded list.
    """
    edges = sorted({int(w[0]) for w in windows} | {int(w[1]) for w in windows})
    pieces: list[list[float]] = []
    for lo, hi in itertools.pairwise(edges):
        if hi <= floor:
            continue
        factor = 1.0
        for start, end, f in windows:
            if start <= lo and hi <= end:
                factor *= f
        if pieces and pieces[-1][2] == factor:
            pieces[-1][1] = hi
        else:
            pieces.append([lo, hi, factor])
    while pieces and pieces[0][2] == 1.0:
        pieces.pop(0)
    while pieces and pieces[-1][2] == 1.0:
        pieces.pop()
    return pieces


def rewind(cmd: Command, command_id: str, step: int, pending: dict | None) -> dict:
    """The trainer's --rewind for an applied rollback: the abandoned steps run to the
    furthest step reached, also across a rollback not yet applied by a segment."""
    through = max(step, int(pending["through_step"]) if pending else 0)
    return {"id": command_id, "to_step": cmd.to_step, "through_step": through,
            "skip_data": cmd.skip_data, "note": cmd.note, "who": cmd.who}
