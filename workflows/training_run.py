"""TrainingRun: the durable five-stage run (DESIGN §1). Deterministic; no I/O here.

Input is the RunSpec as a JSON object (so `temporal workflow start --input` works) plus,
after continue-as-new, a small RunCarry of what is already done. The pieces it decides
with are pure (carry_updates.py, operator_queue.py, escalation.py, steps.py, ...); what
it schedules is in stages.py; its operator handlers and the hold they lead to are in
operator_handlers.py (OperatorHandlers, which also sets the state they share).
"""

from __future__ import annotations

import json
import math

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities.contracts import (
        STAGES,
        WORKFLOW_TYPE,
        RunResult,
        TrainSegmentResult,
    )
    from spec import RunSpec
    from workflows.adapt import decide, needs_decision
    from workflows.carry_updates import (
        bound,
        escalation,
        raise_batch,
        record_segment,
        segment_spec,
        status_view,
    )
    from workflows.distill import distill
    from workflows.escalation import ESCALATE_LOWER_LR, ESCALATE_PAUSE
    from workflows.failures import FAILURE_EXCEPTION_TYPES
    from workflows.gang import blame, launch_fits, members, pick_nodes, run_gang, suspected
    from workflows.interval import choose as choose_interval
    from workflows.operator_handlers import OperatorHandlers
    from workflows.operator_queue import aborting
    from workflows.pins import pin_targets
    from workflows.search import show_progress, show_run_id, show_stage
    from workflows.stages import (
        start_evaluate,
        start_prepare_data,
        start_promote,
        start_scrub,
        start_sweep,
        start_train_segment,
        until,
    )
    from workflows.start import anchor_paths, claim, parse_spec
    from workflows.steps import promotion_step, segment_bounds
    from workflows.sweep_plan import with_params


# Bugs and bad input in workflow code fail the run instead of retrying its task forever;
# nondeterminism from a bad deploy still suspends it (workflows/failures.py).
@workflow.defn(name=WORKFLOW_TYPE, failure_exception_types=FAILURE_EXCEPTION_TYPES)
class TrainingRun(OperatorHandlers):
    # Both take JSON objects: the spec (RunSpec.from_dict), and after continue-as-new the
    # carry (RunCarry.from_json, which also reads the keys older code wrote).
    @workflow.init  # with the input: an update in a run's first task may run before run()
    def __init__(self, spec: dict, carry: dict | None = None) -> None:
        super().__init__(spec, carry)  # the spec, the carry, the stage (OperatorHandlers)
        self._evals: dict[int, float] = {}
        self._promoted: tuple[int, str] | None = None  # (step, uri) once promoted
        self._scrub = None  # the checkpoint scrub running beside a segment, if any
        self._scrubbed_at = -1  # segments_total when this workflow run last started one
        self._distilled: dict | None = None  # the distill stage's record, once it ran

    @workflow.query
    def status(self) -> dict:
        return status_view(self._spec, self._carry, stage=self._stage, evals=self._evals,
                           running=self._running)

    @workflow.run
    async def run(self, spec: dict, carry: dict | None = None) -> RunResult:
        s = self._spec = parse_spec(spec)
        self._trace.start(s.run_id)  # one trace for the run, across continue-as-new
        self._trace.pending(self._carry.operator.queue)  # commands sent before it began
        try:
            return await self._run(s)
        except Exception as exc:  # failed or aborted: its spans end, saying why (not on
            # continue-as-new, a cancellation or an eviction: those are BaseExceptions)
            ended = "aborted" if self._stage == "aborted" else "failed"
            self._trace.end(ended, error=str(exc) or type(exc).__name__,
                            step=self._carry.next_step)
            self._headline.show(self._spec, self._carry, ended)
            raise

    async def _run(self, s: RunSpec) -> RunResult:
        c = self._carry  # built by __init__: commands accepted in the first task are in it
        # relative paths: one place for every worker and child (workflows/start.py)
        self._raw_spec, s = await anchor_paths(self._raw_spec, s)
        self._spec = s
        show_run_id(s.run_id)
        # the chain's first run claims the id; histories from before the claim skip it
        if c.runs == 1 and not c.stages_done and workflow.patched("claim_run"):
            await claim(s)
        if c.runs == 1 and not c.stages_done:
            await self._event("run_started", "run_started", spec_hash=s.spec_hash())
            self._show()  # a continued run starts with the memo its last run passed on
        work = {"prepare_data": self._prepare_data, "warmup_sweep": self._warmup_sweep,
                "train": self._train, "evaluate": self._evaluate, "promote": self._promote}
        for stage in STAGES:  # in order; a run continued as new skips the ones it has done
            if stage not in c.stages_done:
                await work[stage](s)
        assert self._promoted is not None
        step, uri = self._promoted
        # After promotion, when the spec asks (off by default). Only a spec with distill
        # has the stage, and no history recorded before it has one; the marker keeps it
        # so should a later change move the stage.
        if s.distill.enabled and workflow.patched("distill_stage"):
            await self._distill(s, step)
        self._stage = "completed"
        self._show()
        await self._event("run_finished", "run_finished", status="completed")
        self._trace.end("completed", step=c.next_step, promoted_step=step)
        return RunResult(run_id=s.run_id, status="completed", stages=c.stages_done,
                         initial_val_loss=self._evals.get(0, math.nan),
                         final_val_loss=self._evals[step], final_step=c.next_step,
                         promoted_checkpoint=uri, best_params=c.best_params, workflow_runs=c.runs,
                         distilled=self._distilled)

    # ---- the five stages (contracts.STAGES) ------------------------------------------------
    async def _prepare_data(self, s: RunSpec) -> None:
        await self._begin("prepare_data")
        data = await self._unless_aborted(start_prepare_data(self._raw_spec, s))
        self._carry.dataset_uri = data.manifest_uri
        await self._finish("prepare_data", dataset=data.manifest_uri, cache_hit=data.cache_hit,
                           train_tokens=data.train_tokens)

    async def _warmup_sweep(self, s: RunSpec) -> None:
        c = self._carry
        await self._begin("warmup_sweep")
        if s.sweep.enabled:
            result = await self._unless_aborted(await start_sweep(self._raw_spec, c.dataset_uri))
            c.best_params = result.best_params
        await self._finish("warmup_sweep", best_params=c.best_params, enabled=s.sweep.enabled)

    async def _train(self, s: RunSpec) -> None:
        c = self._carry
        if c.next_step == 0 and not c.hold.held:
            await self._begin("train")
        self._stage = "train"
        segments_this_run = 0
        while True:
            if c.hold.held:  # continued as new while held: hold on, already announced
                await self._hold(c.hold.held["stage"], c.hold.held["reason"])
            if c.early_stopped:
                break
            await self._apply_operator()  # pause / rollback / LR / abort, at a step boundary
            if c.next_step >= s.train.total_steps:
                break
            if (segments_this_run >= s.train.segments_per_run or self._history_full()
                    or self._launch_overflows(s)):
                await self._scrub_settled(wait=True)
                await self._continue_as_new()  # keep history bounded (DESIGN §3)
            lo, hi = segment_bounds(c.next_step, s)
            if s.train.auto_checkpoint:
                await self._choose_interval(s, lo, hi)
            self._start_scrub(s)
            seg = await self._segment(segment_spec(with_params(s, c.best_params), c), lo, hi)
            segments_this_run += 1
            await self._scrub_settled(wait=False)
            if seg is None:  # stopped before the trainer answered: resume from storage
                continue
            # applied (the trainer's event makes a retry a no-op)
            c.operator.pending_rollback = None
            if c.operator.rollback_pins:  # its targets need no protection any more
                await pin_targets(s, c.operator.rollback_pins, None)
                c.operator.rollback_pins = []
            record_segment(c, seg)
            # a loss that shook, answered by a larger batch from the next segment on
            if seg.grad_accum_asked and workflow.patched("raise_batch") and (
                    raised := raise_batch(c, with_params(s, c.best_params), seg)):
                await self._event("batch_raised", f"batch_raised/{seg.final_step}/"
                                  f"{raised['to_grad_accum']}", **raised)
            show_progress(c.next_step, seg.train_loss)
            self._show()
            if seg.rollbacks:
                await self._escalate()
            bound(c, s.spikes)
        await self._scrub_settled(wait=True)
        await self._finish("train", final_step=c.next_step, segments=c.segments_total,
                           rollbacks=c.escalation.rollbacks_total, early_stopped=c.early_stopped)

    async def _evaluate(self, s: RunSpec) -> None:
        await self._begin("evaluate")
        c = self._carry
        evaluated = await self._unless_aborted(start_evaluate(
            with_params(s, c.best_params), c.dataset_uri, [0, c.next_step]))
        self._evals = {p.step: p.val_loss for p in evaluated.results}
        await self._finish("evaluate", val_loss={str(k): v for k, v in self._evals.items()})

    async def _promote(self, s: RunSpec) -> None:
        await self._begin("promote")
        chosen = promotion_step(s.run_id, self._evals)
        promoted = await self._unless_aborted(
            start_promote(with_params(s, self._carry.best_params), chosen))
        self._promoted = (chosen, promoted.uri)
        await self._finish("promote", step=promoted.step, uri=promoted.uri)

    async def _distill(self, s: RunSpec, step: int) -> None:
        """The student (and its no-teacher baseline) from the promoted step: child runs of
        their own, promoted beside this one (workflows/distill.py)."""
        await self._begin("distill")
        self._distilled = await distill(s, step, self._evals[step], self._unless_aborted)
        await self._finish("distill", **self._distilled)

    # ---- interruptible work ------------------------------------------------------------
    async def _segment(self, train_spec: RunSpec, lo: int, hi: int) -> TrainSegmentResult | None:
        """One training segment. An operator command stops it gracefully: the activity is
        cancelled, its trainer commits a checkpoint at its current step and the activity
        returns that (stopped="interrupted"); None when it was stopped before it ran."""
        c = self._carry
        if train_spec.train.nodes > 1:
            return await self._gang_segment(train_spec, lo, hi)
        handle = start_train_segment(train_spec, c, lo, hi)
        self._running, began = (lo, hi), workflow.now()
        self._show()
        try:
            return await until(handle, lambda: bool(c.operator.queue))
        except ActivityError as err:
            failure = needs_decision(err)
            # histories from before the decide_failures patch failed the run on DiskFull:
            # they replay so
            if failure is None or not workflow.patched("decide_failures"):
                raise
        finally:
            self._running = None
            c.interval.train_wall_s += (workflow.now() - began).total_seconds()
        await self._decide(train_spec, lo, failure)
        return None  # the loop schedules the segment again, from storage

    def _launch_overflows(self, s: RunSpec) -> bool:
        """A multi-node launch would carry this execution's history past its budget
        (workflows/gang.py launch_fits): continue as new first. Histories from before the
        budget replay without it."""
        if s.train.nodes <= 1:
            return False
        info = workflow.info()
        return not launch_fits(
            info.get_current_history_length(), info.get_current_history_size(),
            self._carry.gang.nodes_used or s.train.nodes, len(json.dumps(s.to_dict()))
        ) and workflow.patched("launch_history_budget")

    async def _gang_segment(self, s: RunSpec, lo: int, hi: int) -> TrainSegmentResult | None:
        """A multi-node segment (workflows/gang.py): choose the nodes (or wait for them),
        launch one member per node, all or nothing. None: launch again from storage."""
        c = self._carry
        nodes = await pick_nodes(s, c, waiting=self._waiting_for_nodes,
                                 stop=lambda: bool(c.operator.queue) or self._history_full())
        if nodes is None:
            return None
        used = c.gang.nodes_used or s.train.nodes
        if len(nodes) != used:
            await self._event("nodes_changed", f"nodes_changed/{lo}/{len(nodes)}",
                              from_nodes=used, to_nodes=len(nodes), set_aside=c.gang.set_aside,
                              reason=f"{len(nodes)} healthy nodes after {s.ops.node_wait_s:.0f}s "
                                     f"waiting; train.min_nodes={s.train.min_nodes}")
            c.gang.nodes_used = len(nodes)
        launch = c.gang.launches
        c.gang.launches += 1
        team = members(nodes, f"{s.run_id}/{lo}-{hi}/{launch}")
        handles = [start_train_segment(s, c, lo, hi, gang=m, queue=n.queue)
                   for m, n in zip(team, nodes)]
        self._running, began = (lo, hi), workflow.now()
        self._show()
        try:
            out = await run_gang(handles, [n.name for n in nodes], lambda: bool(c.operator.queue))
        finally:
            self._running = None
            c.interval.train_wall_s += (workflow.now() - began).total_seconds()
        if out.fatal is not None:
            raise out.fatal
        if out.decision is not None:
            await self._decide(s, lo, out.decision)
            return None
        if not out.failures:
            c.gang.repeat = {}
            # failures in a row end, but for nodes the trainer suspected of silent data
            # corruption; a history from before the trainer named them replays without
            suspects = getattr(out.result, "suspects", None) or []
            if suspects and not workflow.patched("count_suspects"):
                suspects = []
            for kind, event_id, payload in suspected(
                    c, s, suspects, [n.name for n in nodes], lo=lo, hi=hi, launch=launch):
                await self._event(kind, event_id, **payload)
            return out.result
        c.interval.faults_seen += 1  # the launch failed (workflows/interval.py counts it)
        verdict = blame(c, s, out.failures, lo=lo, hi=hi, launch=launch,
                        now=workflow.now().timestamp())
        for kind, event_id, payload in verdict.events:
            await self._event(kind, event_id, **payload)
        c.after_fault = verdict.after_fault or c.after_fault
        if verdict.hold:
            await self._hold("needs_attention", verdict.hold, **verdict.hold_payload)
        return None

    async def _waiting_for_nodes(self, reason: str | None) -> None:
        """Too few healthy nodes: say so (status, stage, an event), or that it is over."""
        c = self._carry
        if reason is None:
            await self._event("nodes_available", f"nodes_available/{c.next_step}/{c.gang.launches}",
                              waited_s=round(
                                  workflow.now().timestamp() - c.gang.waiting["since"], 1))
            c.gang.waiting, self._stage = None, "train"
        else:
            self._stage = "waiting_for_nodes"
            await self._event("waiting_for_nodes",
                              f"waiting_for_nodes/{c.next_step}/{c.gang.launches}", reason=reason)
        show_stage(self._stage)
        self._show()

    async def _decide(self, s: RunSpec, lo: int, failure: ApplicationError) -> None:
        """A failure a plain retry would repeat (workflows/adapt.py:decide): adapt the
        micro-batch and go on, or hold in needs_attention with the evidence and the fix."""
        c = self._carry
        c.interval.faults_seen += 1  # the segment failed (workflows/interval.py counts it)
        d = decide(s, c.micro_split, failure)
        c.after_fault = d.after_fault or c.after_fault  # the next segment's recovery names it
        if d.micro_split:
            await self._event("oom_adapted", f"oom_adapted/{lo}/{d.micro_split}", **d.payload)
            c.micro_split = d.micro_split
        else:
            await self._hold("needs_attention", d.reason, **d.payload)

    async def _choose_interval(self, s: RunSpec, lo: int, hi: int) -> None:
        """train.checkpoint_every "auto": the next segment's interval by Young-Daly from
        what the run has measured (workflows/interval.py), recorded with its inputs."""
        c = self._carry
        chosen = choose_interval(s, c)
        previous, c.interval.checkpoint_every = c.interval.checkpoint_every, chosen.steps
        c.interval.chosen += 1
        await self._event("checkpoint_interval",
                          f"checkpoint_interval/{lo}-{hi}/{c.interval.chosen}",
                          segment=[lo, hi], previous_steps=previous or None, **chosen.payload)

    async def _unless_aborted(self, handle):
        """Await a stage's activity or child workflow; an `abort` cancels it and ends the run."""
        result = await until(handle, lambda: aborting(self._carry))
        if result is None:
            await self._apply_operator()  # the abort: raises RunAborted
        return result

    # ---- the checkpoint scrub, beside the segments (storage/scrub.py) --------------------
    def _start_scrub(self, s: RunSpec) -> None:
        """Every storage.scrub_every segments, one pass beside the next segment, on the data
        worker (it does not train); one at a time. Histories from before it replay without."""
        c, every = self._carry, s.storage.scrub_every
        if (self._scrub is None and every and c.segments_total % every == 0
                and c.segments_total and self._scrubbed_at != c.segments_total
                and workflow.patched("checkpoint_scrub")):
            self._scrubbed_at = c.segments_total
            self._scrub = start_scrub(self._raw_spec, s)

    async def _scrub_settled(self, wait: bool) -> None:
        """Collect a finished pass, or wait for it where continuing as new or ending the
        stage would abandon it. Its findings are in the event log (checkpoint_corrupt,
        needs_attention); a failed pass is logged, never the run's failure."""
        if self._scrub is None or not (wait or self._scrub.done()):
            return
        handle, self._scrub = self._scrub, None
        try:
            found = await handle
        except ActivityError as err:
            workflow.logger.warning("checkpoint scrub failed: %s", err.cause or err)
            return
        if found.corrupt or found.promoted_corrupt:
            workflow.logger.warning("checkpoint scrub: corrupt %s, uncommitted %s, needs "
                                    "attention %s", found.corrupt + found.promoted_corrupt,
                                    found.uncommitted, found.needs_attention)

    # ---- spike escalation: continue / lower the LR / pause for a human ------------------
    async def _escalate(self) -> None:
        s, c = self._spec, self._carry
        assert s is not None
        action, reason, counted = escalation(c, s.spikes)
        if action == ESCALATE_LOWER_LR:
            window = c.escalation.lr_windows[-1]  # escalation() appended it
            await self._event("lr_adjusted", f"lr_adjusted/{c.next_step}", reason=reason,
                              scale=s.spikes.lr_backoff, from_step=window[0],
                              until_step=window[1], rollback_steps=counted)
        elif action == ESCALATE_PAUSE:
            await self._hold("needs_attention", reason, rollback_steps=counted,
                             lr_windows=c.escalation.lr_windows,
                             fix="inspect the rollback and loss_spike events, then "
                                 f"`mainspring run resume {s.run_id}`")

    # ---- stage bookkeeping: search attributes + events via a local activity ---------
    async def _begin(self, stage: str) -> None:
        self._stage = stage
        self._trace.begin(stage)  # its activities' spans are its children
        show_stage(stage)
        self._show()
        await self._event("stage_started", f"stage_started/{stage}", stage=stage)

    async def _finish(self, stage: str, **payload: object) -> None:
        self._carry.stages_done.append(stage)
        self._trace.finish(stage, **payload)
        await self._event("stage_finished", f"stage_finished/{stage}", stage=stage, **payload)
