"""TrainingRun: the durable five-stage run (DESIGN §1). Deterministic; no I/O here.

Input is the RunSpec as a JSON object (so `temporal workflow start --input` works) plus,
after continue-as-new, a small RunCarry of what is already done.
"""

from __future__ import annotations

import math
from datetime import timedelta

from opentelemetry import trace
from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ApplicationError, is_cancelled_exception
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from activities.contracts import (
        DATA_QUEUE,
        EVALUATE,
        PREPARE_DATA,
        PROMOTE,
        RECORD_EVENT,
        TRAIN_SEGMENT,
        TRAINER_QUEUE,
        WORKFLOW_TYPE,
        EvaluateInput,
        EvaluateResult,
        PrepareDataInput,
        PrepareDataResult,
        PromoteInput,
        PromoteResult,
        RecordEventInput,
        RunCarry,
        RunResult,
        SweepInput,
        TrainSegmentInput,
        TrainSegmentResult,
    )
    from common.errors import BadConfig
    from spec import RunSpec
    from workflows.carry import bounded, status_view
    from workflows.failures import FAILURE_EXCEPTION_TYPES
    from workflows.operator import (
        UPDATES_PER_RUN,
        Refused,
        admit,
        lr_window,
        not_applied,
        parse_command,
        rewind,
    )
    from workflows.pins import pin_targets
    from workflows.policy import (
        ESCALATE_LOWER_LR,
        ESCALATE_PAUSE,
        escalate,
        rollback_allowance,
        segment_bounds,
        segment_options,
        short_options,
        with_params,
    )
    from workflows.start import claim, parse_spec
    from workflows.sweep import Sweep

RUN_ID = SearchAttributeKey.for_keyword("MainspringRunId")
STAGE = SearchAttributeKey.for_keyword("MainspringStage")
STEP = SearchAttributeKey.for_int("MainspringStep")
LOSS = SearchAttributeKey.for_float("MainspringLoss")


# Bugs and bad input in workflow code fail the run instead of retrying its task forever;
# nondeterminism from a bad deploy still suspends it (workflows/failures.py).
@workflow.defn(name=WORKFLOW_TYPE, failure_exception_types=FAILURE_EXCEPTION_TYPES)
class TrainingRun:
    @workflow.init  # with the input: an update in a run's first task may run before run()
    def __init__(self, spec: dict, carry: RunCarry | None = None) -> None:
        self._raw_spec = spec
        try:  # for the update validators only; run() fails the run on a bad spec (parse_spec)
            self._spec: RunSpec | None = RunSpec.from_dict(spec)
        except BadConfig:
            self._spec = None
        self._carry = carry or RunCarry()
        # continued as new while held: held from the first task on, before run() gets there
        self._stage = self._carry.held["stage"] if self._carry.held else "starting"
        self._evals: dict[int, float] = {}
        self._span = None  # the current stage's OTel span (replay-safe via the plugin)
        self._resume_note: str | None = None
        self._resume_who = ""
        self._running: tuple[int, int] | None = None  # [lo, hi) of the running segment
        self._updates = 0  # updates accepted by this workflow run (Temporal limits them per run)

    @workflow.query
    def status(self) -> dict:
        return status_view(self._spec, self._carry, stage=self._stage, evals=self._evals,
                           running=self._running)

    # ---- operator commands (workflows/operator.py; `mainspring run pause|resume|...`) ------
    @workflow.update
    async def pause(self, args: dict | str | None = None) -> dict:
        """Stop the running segment at its next step (with a checkpoint) and wait for
        `resume`. Before training starts, the run pauses when it gets there."""
        return self._accept("pause", args)

    @workflow.update
    async def resume(self, args: dict | str | None = None) -> dict:
        """Continue a run paused by `pause` or in needs_attention; the rollback budget
        starts afresh from the current step."""
        cmd = parse_command("resume", args)
        self._updates += 1
        self._resume_note = cmd.note or "resumed by operator"
        self._resume_who = cmd.who
        return {"run_id": self._spec.run_id if self._spec else "", "step": self._carry.next_step,
                "reason_was": self._carry.held["reason"] if self._carry.held else ""}

    @workflow.update
    async def rollback(self, args: dict) -> dict:
        """Go back to the newest checkpoint at or before `to_step` and (skip_data, default)
        skip the data the abandoned steps read. Its target is pinned against retention
        before the command is queued (workflows/pins.py)."""
        pin = ""
        if self._spec is not None and workflow.patched("pin_rollback"):
            pin = f"pin-{workflow.uuid4().hex[:16]}"
            await pin_targets(self._spec, [pin], parse_command("rollback", args).to_step)
        return self._accept("rollback", args, pin=pin)

    @workflow.update
    async def set_lr_scale(self, args: dict) -> dict:
        """Multiply the scheduled LR by `scale` for `steps` steps (0: to the end) from the
        step the running segment stops at."""
        return self._accept("set_lr_scale", args)

    @workflow.signal
    def abort(self, args: dict | str | None = None) -> None:
        """Stop at a checkpoint and end the run (it fails with type RunAborted)."""
        try:
            self._check("abort", args)
        except ApplicationError:
            workflow.logger.warning("abort ignored: the run has ended or is being aborted")
            return
        self._accept("abort", args)

    @pause.validator
    def _pause_ok(self, args: dict | str | None = None) -> None:
        self._check("pause", args)

    @resume.validator
    def _resume_ok(self, args: dict | str | None = None) -> None:
        self._check("resume", args)

    @rollback.validator
    def _rollback_ok(self, args: dict) -> None:
        self._check("rollback", args)

    @set_lr_scale.validator
    def _set_lr_scale_ok(self, args: dict) -> None:
        self._check("set_lr_scale", args)

    def _check(self, name: str, args: object) -> None:
        c, total = self._carry, self._spec.train.total_steps if self._spec else 0
        try:
            # while a segment runs, the run is somewhere before its end: a rollback target
            # is checked against that, and again once the segment has stopped
            step = self._running[1] if self._running else c.next_step
            why = admit(parse_command(name, args), stage=self._stage, step=step,
                        total_steps=total, queued=tuple(q["name"] for q in c.operator_queue),
                        oldest_step=c.oldest_step, lr_windows=len(c.lr_windows))
        except Refused as exc:
            why = str(exc)
        if why:
            raise ApplicationError(why, type="Refused", non_retryable=True)

    def _accept(self, name: str, args: object, pin: str = "") -> dict:
        c = self._carry
        c.operator_actions += 1
        self._updates += name != "abort"  # abort is a signal
        entry = {"id": f"op{c.operator_actions}", "name": name, "raw": args,
                 "accepted_at_step": c.next_step, **({"pin": pin} if pin else {})}
        c.operator_queue.append(entry)
        when = ("at the running segment's next step" if self._running
                else "now" if c.held else "when training starts")
        return {"run_id": self._spec.run_id if self._spec else "", "accepted": name,
                "id": entry["id"], "step": c.next_step, "applies": when}

    @workflow.run
    async def run(self, spec: dict, carry: RunCarry | None = None) -> RunResult:
        s = self._spec = parse_spec(spec)
        c = self._carry  # built by __init__: commands accepted in the first task are in it
        workflow.upsert_search_attributes([RUN_ID.value_set(s.run_id)])
        # the chain's first run claims the id; histories from before the claim skip it
        if c.runs == 1 and not c.stages_done and workflow.patched("claim_run"):
            await claim(s)
        if c.runs == 1 and not c.stages_done:
            await self._event("run_started", "run_started", spec_hash=s.spec_hash())

        if "prepare_data" not in c.stages_done:
            await self._begin("prepare_data")
            data = await self._unless_aborted(workflow.start_activity(
                PREPARE_DATA, PrepareDataInput(spec), task_queue=DATA_QUEUE,
                result_type=PrepareDataResult, **short_options(s)))
            c.dataset_uri = data.manifest_uri
            await self._finish("prepare_data", dataset=data.manifest_uri, cache_hit=data.cache_hit,
                               train_tokens=data.train_tokens)

        if "warmup_sweep" not in c.stages_done:
            await self._begin("warmup_sweep")
            if s.sweep.enabled:
                result = await self._unless_aborted(await workflow.start_child_workflow(
                    Sweep.run, SweepInput(spec, c.dataset_uri),
                    id=f"{workflow.info().workflow_id}-sweep",
                    task_queue=workflow.info().task_queue))
                c.best_params = result.best_params
            await self._finish("warmup_sweep", best_params=c.best_params, enabled=s.sweep.enabled)

        train_spec = with_params(s, c.best_params)
        if "train" not in c.stages_done:
            if c.next_step == 0 and not c.held:
                await self._begin("train")
            self._stage = "train"
            segments_this_run = 0
            while True:
                if c.held:  # continued as new while held: hold on, already announced
                    await self._hold(c.held["stage"], c.held["reason"])
                if c.early_stopped:
                    break
                await self._apply_operator()  # pause / rollback / LR / abort, at a step boundary
                if c.next_step >= s.train.total_steps:
                    break
                if segments_this_run >= s.train.segments_per_run or self._history_full():
                    await self._continue_as_new()  # keep history bounded (DESIGN §3)
                seg = await self._segment(train_spec, *segment_bounds(c.next_step, s))
                segments_this_run += 1
                if seg is None:  # stopped before the trainer answered: resume from storage
                    continue
                c.rewind = None  # applied (the trainer's event makes a retry a no-op)
                if c.rewind_pins:  # its targets need no protection any more
                    await pin_targets(s, c.rewind_pins, None)
                    c.rewind_pins = []
                c.next_step, c.train_loss = seg.final_step, seg.train_loss
                c.segments_total += 1
                if seg.oldest_committed_step is not None:
                    c.oldest_step = seg.oldest_committed_step
                workflow.upsert_search_attributes([STEP.value_set(c.next_step),
                                                   LOSS.value_set(_finite(seg.train_loss))])
                if seg.stopped == "overfitting":
                    c.early_stopped = "overfitting"  # after the escalation below (it may hold)
                if seg.rollbacks:
                    c.rollback_steps += [r["at_step"] for r in seg.rollbacks]
                    c.rollbacks_total += len(seg.rollbacks)
                    await self._escalate()
                self._bound_carry()
            await self._finish("train", final_step=c.next_step, segments=c.segments_total,
                               rollbacks=c.rollbacks_total, early_stopped=c.early_stopped)

        await self._begin("evaluate")
        evaluated = await self._unless_aborted(workflow.start_activity(
            EVALUATE, EvaluateInput(train_spec.to_dict(), c.dataset_uri, [0, c.next_step]),
            task_queue=TRAINER_QUEUE, result_type=EvaluateResult, **short_options(s)))
        self._evals = {p.step: p.val_loss for p in evaluated.results}
        await self._finish("evaluate", val_loss={str(k): v for k, v in self._evals.items()})

        await self._begin("promote")
        trained = [st for st in self._evals if st > 0]
        if not trained:  # every trained checkpoint was corrupt (evaluate fell back to step 0)
            raise ApplicationError(
                f"run {s.run_id}: no trained checkpoint could be evaluated; see the "
                f"checkpoint_corrupt events", {"evaluated": sorted(self._evals)},
                type="BadData", non_retryable=True)
        chosen = min(trained, key=lambda st: self._evals[st])
        promoted = await self._unless_aborted(workflow.start_activity(
            PROMOTE, PromoteInput(train_spec.to_dict(), chosen), task_queue=DATA_QUEUE,
            result_type=PromoteResult, **short_options(s)))
        await self._finish("promote", step=promoted.step, uri=promoted.uri)
        self._stage = "completed"
        await self._event("run_finished", "run_finished", status="completed")
        return RunResult(run_id=s.run_id, status="completed", stages=c.stages_done,
                         initial_val_loss=self._evals.get(0, math.nan), final_val_loss=self._evals[chosen],
                         final_step=c.next_step, promoted_checkpoint=promoted.uri,
                         best_params=c.best_params, workflow_runs=c.runs)

    # ---- interruptible work ------------------------------------------------------------
    async def _segment(self, train_spec: RunSpec, lo: int, hi: int) -> TrainSegmentResult | None:
        """One training segment. An operator command stops it gracefully: the activity is
        cancelled, its trainer commits a checkpoint at its current step and the activity
        returns that (stopped="interrupted"); None when it was stopped before it ran."""
        s, c = self._spec, self._carry
        assert s is not None
        handle = workflow.start_activity(
            TRAIN_SEGMENT, TrainSegmentInput(
                train_spec.to_dict(), c.dataset_uri, lo, hi, lr_windows=c.lr_windows,
                max_rollbacks=rollback_allowance(c.rollback_steps, c.budget_from, lo, s.spikes),
                rewind=c.rewind),
            task_queue=TRAINER_QUEUE, result_type=TrainSegmentResult,
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            **segment_options(s))
        self._running = (lo, hi)
        try:
            return await self._until(handle, lambda: bool(c.operator_queue))
        finally:
            self._running = None

    async def _unless_aborted(self, handle):
        """Await a stage's activity or child workflow; an `abort` cancels it and ends the run."""
        result = await self._until(handle, lambda: any(
            q["name"] == "abort" for q in self._carry.operator_queue))
        if result is None:
            await self._apply_operator()  # the abort: raises RunAborted
        return result

    @staticmethod
    async def _until(handle, interrupted) -> object | None:
        """Wait for `handle`; cancel it when `interrupted()` turns true first. The handle's
        result (a graceful stop still returns one), or None when it ended cancelled."""
        await workflow.wait_condition(lambda: handle.done() or interrupted())
        if not handle.done():
            handle.cancel()
        try:
            return await handle
        except BaseException as exc:  # ActivityError / ChildWorkflowError / CancelledError
            if interrupted() and is_cancelled_exception(exc):
                return None
            raise

    # ---- operator commands, applied at a step boundary ----------------------------------
    async def _apply_operator(self) -> None:
        s, c = self._spec, self._carry
        assert s is not None
        while c.operator_queue:
            # an abort goes first: nothing queued before it (a pause) should hold it up
            aborts = [i for i, q in enumerate(c.operator_queue) if q["name"] == "abort"]
            entry = c.operator_queue.pop(aborts[0] if aborts else 0)
            cmd = parse_command(entry["name"], entry["raw"])
            why_not = not_applied(cmd, c.next_step)
            await self._event("operator", f"operator/{entry['id']}", command=cmd.name,
                              args=cmd.args, who=cmd.who, note=cmd.note, id=entry["id"],
                              accepted_at_step=entry["accepted_at_step"], applied=not why_not,
                              **({"why_not": why_not} if why_not else {}))
            if why_not:
                if entry.get("pin"):
                    await pin_targets(s, [entry["pin"]], None)
                continue
            if cmd.name == "pause":
                await self._hold("paused", cmd.note or "paused by operator",
                                 fix=f"`mainspring run resume {s.run_id}`", who=cmd.who)
            elif cmd.name == "rollback":
                c.rewind = rewind(cmd, f"{s.run_id}/{entry['id']}", c.next_step, c.rewind)
                c.rewind_pins += [entry["pin"]] if entry.get("pin") else []
                c.next_step = min(c.next_step, cmd.to_step)
            elif cmd.name == "set_lr_scale":
                c.lr_windows.append(lr_window(cmd, c.next_step, s.train.total_steps))
                self._bound_carry()
            elif cmd.name == "abort":
                await self._abort(cmd.note or "aborted by operator", cmd.who)

    async def _abort(self, reason: str, who: str) -> None:
        s, c = self._spec, self._carry
        assert s is not None
        self._stage = "aborted"
        workflow.upsert_search_attributes([STAGE.value_set("aborted")])
        await self._event("run_finished", "run_finished", status="aborted", reason=reason,
                          who=who, step=c.next_step)
        raise ApplicationError(f"run {s.run_id} aborted by {who or 'operator'} at step "
                               f"{c.next_step}: {reason}", {"step": c.next_step},
                               type="RunAborted", non_retryable=True)

    # ---- spike escalation: continue / lower the LR / pause for a human ------------------
    async def _escalate(self) -> None:
        s, c = self._spec, self._carry
        assert s is not None
        counted = tuple(x for x in c.rollback_steps if x >= c.budget_from)
        action, reason = escalate(counted, c.next_step,
                                  tuple(x for x in c.lowered_at if x >= c.budget_from), s.spikes)
        if action == ESCALATE_LOWER_LR:
            window = [c.next_step, c.next_step + s.spikes.lr_backoff_steps, s.spikes.lr_backoff]
            c.lowered_at.append(c.next_step)
            c.lr_windows.append(window)
            await self._event("lr_adjusted", f"lr_adjusted/{c.next_step}", reason=reason,
                              scale=s.spikes.lr_backoff, from_step=window[0],
                              until_step=window[1], rollback_steps=list(counted))
        elif action == ESCALATE_PAUSE:
            await self._hold("needs_attention", reason, rollback_steps=list(counted),
                             lr_windows=c.lr_windows,
                             fix="inspect the rollback and loss_spike events, then "
                                 f"`mainspring run resume {s.run_id}`")

    async def _hold(self, stage: str, reason: str, **payload: object) -> None:
        """paused / needs_attention: stop looping, say why everywhere, wait for `resume`.
        Rollback, LR and abort commands sent meanwhile are applied at once. A long hold
        continues as new (history and Temporal's per-run update limit stay bounded): the
        new run finds RunCarry.held and comes straight back here."""
        c = self._carry
        new = c.held is None  # else carried over continue-as-new, and announced already
        if new:
            c.pauses += 1
            c.held = {"stage": stage, "reason": reason, "who": str(payload.get("who") or "")}
            self._resume_note = None
        self._stage = stage
        workflow.upsert_search_attributes([STAGE.value_set(stage)])
        if new:
            await self._event(stage, f"{stage}/{c.next_step}/{c.pauses}", reason=reason,
                              **payload)
        while True:
            await workflow.wait_condition(
                lambda: self._resume_note is not None or bool(c.operator_queue))
            if self._resume_note is not None:
                break
            await self._apply_operator()
            if self._resume_note is None and self._history_full():
                await self._continue_as_new()  # returns when a resume came in meanwhile
        c.held, c.budget_from = None, c.next_step  # the operator has looked: budget afresh
        self._bound_carry()
        await self._event("run_resumed", f"run_resumed/{c.next_step}/{c.pauses}",
                          note=self._resume_note, who=self._resume_who, paused_for=reason)
        self._stage = "train"
        workflow.upsert_search_attributes([STAGE.value_set("train")])

    def _history_full(self) -> bool:
        return self._updates >= UPDATES_PER_RUN or workflow.info().is_continue_as_new_suggested()

    async def _continue_as_new(self) -> None:
        """Continue as new with the carry, once every accepted update has run (its effect is
        in the carry). Returns instead when a `resume` was accepted meanwhile, for the hold
        to end in this run."""
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._carry.held and self._resume_note is not None:
            return
        self._carry.runs += 1  # carry only what is done
        workflow.continue_as_new(args=[self._raw_spec, self._carry])

    def _bound_carry(self) -> None:
        c = self._carry
        assert self._spec is not None
        c.rollback_steps, c.lowered_at, c.lr_windows = bounded(c, self._spec.spikes)

    # ---- stage bookkeeping: search attributes + events via a local activity ---------
    async def _begin(self, stage: str) -> None:
        self._stage = stage
        self._span = trace.get_tracer(__name__).start_span(
            f"stage {stage}", attributes={"mainspring.run_id": self._spec.run_id if self._spec else ""})
        workflow.upsert_search_attributes([STAGE.value_set(stage)])
        await self._event("stage_started", f"stage_started/{stage}", stage=stage)

    async def _finish(self, stage: str, **payload: object) -> None:
        self._carry.stages_done.append(stage)
        if self._span is not None:
            self._span.end()
            self._span = None
        await self._event("stage_finished", f"stage_finished/{stage}", stage=stage, **payload)

    async def _event(self, kind: str, event_id: str, **payload: object) -> None:
        s = self._spec
        assert s is not None
        await workflow.execute_local_activity(
            RECORD_EVENT, RecordEventInput(durable=s.storage.durable, run_id=s.run_id, kind=kind,
                                           event_id=event_id, step=self._carry.next_step,
                                           payload=dict(payload)),
            start_to_close_timeout=timedelta(seconds=60))


def _finite(x: float | None) -> float:
    return x if x is not None and math.isfinite(x) else -1.0

