"""Operator commands on a TrainingRun (DESIGN §6): admission, the queue and flood bounds,
pure and I/O-free. The commands themselves (their JSON input and typed, frozen form) are
in common/commands.py, shared with `mainspring run`; the workflow's handlers for them are
workflows/operator_handlers.py, the LR windows set_lr_scale adds workflows/lr_windows.py:

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

Every object may carry "who" (recorded in the `operator` event) and "note" or "reason"; a
bare string is the note. A field the command does not take, or a value of the wrong type
or range, is refused in the update's validator naming the field (Command.from_json), so it
leaves no trace in the workflow history; so is a command the run's state refuses (admit).

Floods coalesce and stay bounded:
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
  furthest step reached (operator_rollback); the later ones with a target at or after the
  step the first one went to are recorded as not applied. A target before the oldest
  checkpoint retention left (oldest_step) is refused.
- A held run continues as new after UPDATES_PER_RUN accepted updates (or when Temporal
  suggests it), so `resume` is never refused for Temporal's per-run limits.
"""

from __future__ import annotations

from typing import Any

from temporalio.exceptions import ApplicationError

from activities.contracts import STAGES
from common.commands import (
    Abort,
    Command,
    CommandInput,
    Pause,
    Refused,
    Resume,
    Rollback,
    SetLrScale,
    as_object,
    command,
)
from common.protocol import OperatorRollback
from workflows.carry import RunCarry
from workflows.lr_windows import MAX_LR_WINDOWS

HELD_STAGES = ("paused", "needs_attention")
# where commands are admitted: before and during training (contracts.STAGES up to train)
TRAINING_STAGES = ("starting", *STAGES[:STAGES.index("train") + 1], *HELD_STAGES)
# Bounds for a command flood. Temporal refuses updates beyond 10 in flight and 2000 per
# workflow run (server dynamic config history.maxInFlightUpdates / history.maxTotalUpdates)
# and suggests continue-as-new at 4 Ki history events; one held-run command costs about six
# events (workflow task, update accepted/completed, the operator event's marker).
MAX_QUEUED = 32  # accepted, not yet applied: far more than a human sends in one stop
UPDATES_PER_RUN = 200  # a held run continues as new after accepting this many updates


def admit(cmd: Command, *, stage: str, step: int, total_steps: int,
          queued: tuple[str, ...], oldest_step: int = 0, lr_windows: int = 0) -> str:
    """Why `cmd` is refused now ('' when admitted). `queued`: names of commands accepted
    but not yet applied (they apply at the next step boundary of training); `oldest_step`:
    the oldest committed checkpoint retention left; `lr_windows`: live LR pieces."""
    if stage in ("completed", "aborted", "failed"):
        return f"the run has ended (stage {stage!r})"
    if "abort" in queued:
        return "the run is being aborted"
    if isinstance(cmd, Abort):
        return ""
    if stage not in TRAINING_STAGES or step >= total_steps:
        return f"training is over (stage {stage!r}, step {step}); only abort applies now"
    if isinstance(cmd, Resume):
        if stage not in HELD_STAGES:
            return f"run is not paused (stage {stage!r}); nothing to resume"
        return ""
    if isinstance(cmd, Pause) and (stage in HELD_STAGES or "pause" in queued):
        return f"run is already paused (stage {stage!r})" if stage in HELD_STAGES \
            else "a pause is already on its way"
    if len(queued) >= MAX_QUEUED:
        return f"{len(queued)} commands already waiting; wait until they apply"
    if isinstance(cmd, Rollback) and cmd.to_step >= step:
        return (f"rollback to step {cmd.to_step} is not before the run's step {step}; "
                f"pick a step < {step}" if step else "nothing has been trained yet")
    if isinstance(cmd, Rollback) and cmd.to_step < oldest_step:
        return (f"rollback to step {cmd.to_step}: no checkpoint at or before it is left "
                f"(retention keeps steps >= {oldest_step}); the oldest step you can roll "
                f"back to is {oldest_step}")
    waiting = queued.count("set_lr_scale")
    if isinstance(cmd, SetLrScale) and lr_windows + 2 * (waiting + 1) > MAX_LR_WINDOWS:
        return (f"set_lr_scale: the LR schedule has {lr_windows} windows"
                + (f" and {waiting} set_lr_scale command(s) waiting" if waiting else "")
                + f"; it holds at most {MAX_LR_WINDOWS} (a command adds up to 2). A window "
                  "is dropped once no rollback can reach it (retention removed every "
                  "checkpoint before its end); until then send fewer, longer changes")
    return ""


def refusal(kind: type[Command], args: CommandInput, c: RunCarry, *, stage: str, step: int,
            total_steps: int, strict: bool = True) -> str:
    """Why the command `kind` with input `args` is refused now for a run with carry `c`
    ('' when admitted): its input, then admit()."""
    try:
        cmd = kind.from_json(args, strict=strict)
    except Refused as exc:
        return str(exc)
    return admit(cmd, stage=stage, step=step, total_steps=total_steps,
                 queued=tuple(q["name"] for q in c.operator.queue), oldest_step=c.oldest_step,
                 lr_windows=len(c.escalation.lr_windows))


def enqueue(c: RunCarry, kind: type[Command], args: CommandInput, pin: str) -> dict[str, Any]:
    """An admitted command into the carry's queue; its entry: id, name, the input as sent
    (read again when it applies), the step it was accepted at, its rollback pin."""
    c.operator.actions += 1
    entry = {"id": f"op{c.operator.actions}", "name": kind.name, "raw": args,
             "accepted_at_step": c.next_step, **({"pin": pin} if pin else {})}
    c.operator.queue.append(entry)
    return entry


def not_applied(cmd: Command, step: int) -> str:
    """Why an accepted command does nothing at the boundary ('' when it applies): a rollback
    was admitted against the running segment's end, and the run stopped before its target."""
    if isinstance(cmd, Rollback) and cmd.to_step >= step:
        return f"the run stopped at step {step}, not after step {cmd.to_step}"
    return ""


def next_command(c: RunCarry) -> tuple[dict[str, Any], Command, str]:
    """The queued command to apply next, taken off the queue: an abort goes first (nothing
    queued before it, a pause, should hold it up). (entry, command, why it does nothing)."""
    aborts = [i for i, q in enumerate(c.operator.queue) if q["name"] == "abort"]
    entry = c.operator.queue.pop(aborts[0] if aborts else 0)
    cmd = command(entry["name"], entry["raw"], strict=False)  # admitted already
    return entry, cmd, not_applied(cmd, c.next_step)


def operator_event(entry: dict[str, Any], cmd: Command, why_not: str) -> dict[str, Any]:
    """The `operator` event's payload: the command as sent, whether it applied."""
    return {"command": cmd.name, "args": as_object(entry["raw"]), "who": cmd.who,
            "note": cmd.note, "id": entry["id"], "accepted_at_step": entry["accepted_at_step"],
            "applied": not why_not, **({"why_not": why_not} if why_not else {}),
            **({"span_id": entry["span_id"]} if entry.get("span_id") else {})}


def aborting(c: RunCarry) -> bool:
    """Whether an abort waits in the queue (it interrupts any stage, not only training)."""
    return any(q["name"] == "abort" for q in c.operator.queue)


def run_aborted(run_id: str, who: str, step: int, reason: str) -> ApplicationError:
    """How an applied abort ends the run: it fails with type RunAborted (a workflow cannot
    meaningfully cancel itself, DESIGN §5)."""
    return ApplicationError(f"run {run_id} aborted by {who or 'operator'} at step {step}: "
                            f"{reason}", {"step": step}, type="RunAborted", non_retryable=True)


def operator_rollback(cmd: Rollback, command_id: str, step: int,
                      pending: OperatorRollback | None) -> OperatorRollback:
    """What the trainer applies for a rollback applied at `step` (its --rollback): the
    abandoned steps run to the furthest step reached, also across a rollback not yet
    applied by a segment (`pending`)."""
    through = max(step, pending.through_step if pending else 0)
    return OperatorRollback(id=command_id, to_step=cmd.to_step, through_step=through,
                            skip_data=cmd.skip_data, note=cmd.note, who=cmd.who)
