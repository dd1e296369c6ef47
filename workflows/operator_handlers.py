"""The operator's side of a TrainingRun (DESIGN §6): its update and signal handlers with
their validators, the commands applied at a step boundary, and the hold (paused /
needs_attention) they and the run's own decisions lead to. Deterministic; no I/O here.

TrainingRun (workflows/training_run.py) inherits these; Temporal registers inherited
handlers as its own. OperatorHandlers.__init__ sets the state they read and write, from
the run's input: the spec, the carry (RunCarry: the operator queue, the hold), the stage,
the running segment, the resume note, the updates accepted and the headline. What is pure
(admission, the queue, flood bounds) is workflows/operator_queue.py.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from common.commands import (
        Abort,
        Command,
        CommandInput,
        Pause,
        Resume,
        Rollback,
        SetLrScale,
    )
    from common.errors import BadConfig
    from spec import RunSpec
    from workflows.carry import RunCarry
    from workflows.carry_updates import apply_rollback, bound
    from workflows.headline import Headline
    from workflows.lr_windows import lr_window
    from workflows.operator_queue import (
        UPDATES_PER_RUN,
        enqueue,
        next_command,
        operator_event,
        refusal,
        run_aborted,
    )
    from workflows.pins import pin_targets
    from workflows.search import show_stage
    from workflows.stages import record_event
    from workflows.tracing import RunTrace


class OperatorHandlers:
    """Handlers and the hold, over the run's state (set here, from the run's input)."""

    def __init__(self, raw_spec: dict, carry: dict | None) -> None:
        self._raw_spec = raw_spec
        try:  # for the update validators only; run() fails the run on a bad spec (parse_spec)
            self._spec: RunSpec | None = RunSpec.from_dict(raw_spec)
        except BadConfig:
            self._spec = None
        self._carry = RunCarry.from_json(carry)  # also reads the keys older code wrote
        # continued as new while held: held from the first task on, before run() gets there
        self._stage = self._carry.hold.held["stage"] if self._carry.hold.held else "starting"
        self._running: tuple[int, int] | None = None  # [lo, hi) of the running segment
        self._resume_note: str | None = None
        self._resume_who = ""
        self._updates = 0  # updates accepted by this workflow run (Temporal limits them per run)
        self._headline = Headline()  # memo + current details (workflows/headline.py)
        self._trace = RunTrace(self._carry.trace)  # the run's root, stage and command spans

    # ---- operator commands (workflows/operator_queue.py; `mainspring run pause|...`) -------
    # Each takes its JSON input as sent (common/commands.py:CommandInput); the validator reads it
    # strictly, what it admitted is read again (Command.from_json, not strict) where used.
    @workflow.update
    async def pause(self, args: CommandInput = None) -> dict:
        """Stop the running segment at its next step (with a checkpoint) and wait for
        `resume`. Before training starts, the run pauses when it gets there."""
        return self._accept(Pause, args)

    @workflow.update
    async def resume(self, args: CommandInput = None) -> dict:
        """Continue a run paused by `pause` or in needs_attention; the rollback budget
        starts afresh from the current step."""
        cmd = Resume.from_json(args, strict=False)
        self._updates += 1
        self._resume_note = cmd.note or "resumed by operator"
        self._resume_who = cmd.who
        return {"run_id": self._spec.run_id if self._spec else "", "step": self._carry.next_step,
                "reason_was": self._carry.hold.held["reason"] if self._carry.hold.held else ""}

    @workflow.update
    async def rollback(self, args: CommandInput = None) -> dict:
        """Go back to the newest checkpoint at or before `to_step` and (skip_data, default)
        skip the data the abandoned steps read. Its target is pinned against retention
        before the command is queued (workflows/pins.py)."""
        pin = ""
        if self._spec is not None and workflow.patched("pin_rollback"):
            pin = f"pin-{workflow.uuid4().hex[:16]}"
            await pin_targets(self._spec, [pin], Rollback.from_json(args, strict=False).to_step)
        return self._accept(Rollback, args, pin=pin)

    @workflow.update
    async def set_lr_scale(self, args: CommandInput = None) -> dict:
        """Multiply the scheduled LR by `scale` for `steps` steps (0: to the end) from the
        step the running segment stops at."""
        return self._accept(SetLrScale, args)

    @workflow.signal
    def abort(self, args: CommandInput = None) -> None:
        """Stop at a checkpoint and end the run (it fails with type RunAborted). A signal has
        no validator: its input is read as an accepted command's is."""
        try:
            self._check(Abort, args, strict=False)
        except ApplicationError:
            workflow.logger.warning("abort ignored: the run has ended or is being aborted")
            return
        self._accept(Abort, args)

    @pause.validator
    def _pause_ok(self, args: CommandInput = None) -> None:
        self._check(Pause, args)

    @resume.validator
    def _resume_ok(self, args: CommandInput = None) -> None:
        self._check(Resume, args)

    @rollback.validator
    def _rollback_ok(self, args: CommandInput = None) -> None:
        self._check(Rollback, args)

    @set_lr_scale.validator
    def _set_lr_scale_ok(self, args: CommandInput = None) -> None:
        self._check(SetLrScale, args)

    def _check(self, kind: type[Command], args: CommandInput, strict: bool = True) -> None:
        # while a segment runs, the run is somewhere before its end: a rollback target is
        # checked against that, and again once the segment has stopped
        c = self._carry
        why = refusal(kind, args, c, stage=self._stage, strict=strict,
                      step=self._running[1] if self._running else c.next_step,
                      total_steps=self._spec.train.total_steps if self._spec else 0)
        if why:
            raise ApplicationError(why, type="Refused", non_retryable=True)

    def _accept(self, kind: type[Command], args: CommandInput, pin: str = "") -> dict:
        c = self._carry
        self._updates += kind is not Abort  # abort is a signal
        entry = enqueue(c, kind, args, pin)
        self._trace.command(entry)  # its span in the run's trace, named by its event
        when = ("at the running segment's next step" if self._running
                else "now" if c.hold.held else "when training starts")
        return {"run_id": self._spec.run_id if self._spec else "", "accepted": kind.name,
                "id": entry["id"], "step": c.next_step, "applies": when}


    # ---- operator commands, applied at a step boundary ----------------------------------
    async def _apply_operator(self) -> None:
        s, c = self._spec, self._carry
        assert s is not None
        while c.operator.queue:
            entry, cmd, why_not = next_command(c)  # an abort first
            await self._event("operator", f"operator/{entry['id']}",
                              **operator_event(entry, cmd, why_not))
            if why_not:
                if entry.get("pin"):
                    await pin_targets(s, [entry["pin"]], None)
                continue
            if isinstance(cmd, Pause):
                await self._hold("paused", cmd.note or "paused by operator",
                                 fix=f"`mainspring run resume {s.run_id}`", who=cmd.who)
            elif isinstance(cmd, Rollback):
                apply_rollback(c, cmd, f"{s.run_id}/{entry['id']}", entry.get("pin", ""))
            elif isinstance(cmd, SetLrScale):
                c.escalation.lr_windows.append(lr_window(cmd, c.next_step, s.train.total_steps))
                bound(c, s.spikes)
            elif isinstance(cmd, Abort):
                await self._abort(cmd.note or "aborted by operator", cmd.who)

    async def _abort(self, reason: str, who: str) -> None:
        s, c = self._spec, self._carry
        assert s is not None
        self._stage = "aborted"
        show_stage("aborted")
        self._show()
        await self._event("run_finished", "run_finished", status="aborted", reason=reason,
                          who=who, step=c.next_step)
        raise run_aborted(s.run_id, who, c.next_step, reason)


    async def _hold(self, stage: str, reason: str, **payload: object) -> None:
        """paused / needs_attention: stop looping, say why everywhere, wait for `resume`.
        Rollback, LR and abort commands sent meanwhile are applied at once. A long hold
        continues as new (history and Temporal's per-run update limit stay bounded): the
        new run finds RunCarry.held and comes straight back here."""
        c = self._carry
        new = c.hold.held is None  # else carried over continue-as-new, and announced already
        if new:
            c.hold.pauses += 1
            c.hold.held = {"stage": stage, "reason": reason, "who": str(payload.get("who") or "")}
            self._resume_note = None
        self._stage = stage
        show_stage(stage)
        self._show()
        if new:
            await self._event(stage, f"{stage}/{c.next_step}/{c.hold.pauses}", reason=reason,
                              **payload)
        while True:
            await workflow.wait_condition(
                lambda: self._resume_note is not None or bool(c.operator.queue))
            if self._resume_note is not None:
                break
            await self._apply_operator()
            if self._resume_note is None and self._history_full():
                await self._continue_as_new()  # returns when a resume came in meanwhile
        # the operator has looked: the rollback budget starts afresh
        c.hold.held, c.escalation.budget_from = None, c.next_step
        assert self._spec is not None
        bound(c, self._spec.spikes)
        await self._event("run_resumed", f"run_resumed/{c.next_step}/{c.hold.pauses}",
                          note=self._resume_note, who=self._resume_who, paused_for=reason)
        self._stage = "train"
        show_stage("train")
        self._show()

    def _history_full(self) -> bool:
        return self._updates >= UPDATES_PER_RUN or workflow.info().is_continue_as_new_suggested()

    async def _continue_as_new(self) -> None:
        """Continue as new with the carry, once every accepted update has run (its effect is
        in the carry). Returns instead when a `resume` was accepted meanwhile, for the hold
        to end in this run."""
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._carry.hold.held and self._resume_note is not None:
            return
        self._carry.runs += 1  # carry only what is done
        # the carry's flat JSON object, the shape every earlier carry had (workflows/carry.py)
        workflow.continue_as_new(args=[self._raw_spec, self._carry.to_json()],
                                 memo=self._headline.carried())

    # ---- the headline and the event log, for the run and its commands ---------------
    def _show(self) -> None:
        """The run's headline in the Temporal UI: current details, the memo when it changed."""
        self._headline.show(self._spec, self._carry, self._stage, self._running)

    async def _event(self, kind: str, event_id: str, /, **payload: object) -> None:
        assert self._spec is not None
        await record_event(self._spec, kind, event_id, self._carry.next_step, dict(payload))
