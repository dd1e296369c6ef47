"""Sweep: the warm-up hyperparameter sweep as a child workflow.

Each round asks optuna's sampler (sweep/suggest.py: TPE, multivariate with constant liar, or
GP; spec sweep.sampler) for its points, given every trial so far; trial 0 is the scaling-law
prior (sweep/prior.py: Step Law's learning rate). The suggester runs as the `suggest_trials`
local activity: no CPU work and no optuna here, each round's points (with their
distributions) are in the history, and this workflow's trials are the study's only record,
rebuilt by the activity on every call.
Each trial is a short run of its own (own run id and checkpoints) trained by the same
train_segment activity and scored by held-out loss; the lowest finite loss of a trial that
ran to its end wins. Its `sweep_trial` event carries its point, source, steps, status and
loss: what `mainspring sweep RUN` (ops/cli_sweep.py) prints. Adding payload keys changes no
command, so recorded histories replay as they were.

With sweep.pruning (rungs > 1) a trial trains in segments ending at its rung boundaries
(spec/sweep.py rung_steps); each segment ends with a commit, so stopping there is graceful.
At each boundary but the last its held-out loss is measured (the evaluate activity, as for
a final loss) and the `prune_trial` local activity (optuna's SuccessiveHalvingPruner,
sweep/prune.py) decides from this workflow's records, every trial's losses at every rung so
far, whether it goes on. A pruned trial trains nothing more, is recorded `pruned` with its
rung losses, is told to the sampler as PRUNED and never wins. Without pruning a trial runs
as before, one segment then one evaluation: the same commands, so recorded histories replay
without a patch (none holds a pruned sweep; the spec field did not exist).
"""

from __future__ import annotations

import asyncio
import math
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.contracts import (
        EVALUATE,
        PRUNE_TRIAL,
        RECORD_EVENT,
        SUGGEST_TRIALS,
        SWEEP_WORKFLOW_TYPE,
        TRAIN_SEGMENT,
        TRAINER_QUEUE,
        TRIAL_COMPLETE,
        TRIAL_DIVERGED,
        TRIAL_PRUNED,
        TRIAL_RUNNING,
        EvaluateInput,
        EvaluateResult,
        PruneInput,
        PruneResult,
        RecordEventInput,
        RungRecord,
        SuggestInput,
        SuggestResult,
        SweepInput,
        SweepObservation,
        SweepResult,
        TrainSegmentInput,
        TrainSegmentResult,
        TrialResult,
    )
    from spec import RunSpec
    from spec.sweep import rung_steps
    from workflows.activity_options import segment_options, short_options, suggest_options
    from workflows.failures import FAILURE_EXCEPTION_TYPES
    from workflows.sweep_plan import sweep_rounds, trial_eval_every, trial_spec

# workflow.patched id: a trial's held-out loss is its segment's own online evaluation at the
# step the sweep reads (the evaluate activity only where the segment has none to give)
SCORED_IN_SEGMENT = "trial_scored_in_segment"


@workflow.defn(name=SWEEP_WORKFLOW_TYPE, failure_exception_types=FAILURE_EXCEPTION_TYPES)
class Sweep:
    def __init__(self) -> None:
        # each started trial's status and rung losses, by index: the pruner's records
        self._records: dict[int, RungRecord] = {}

    @workflow.run
    async def run(self, inp: SweepInput) -> SweepResult:
        spec = RunSpec.from_dict(inp.spec)
        trials: list[TrialResult] = []
        for round_no, size in enumerate(sweep_rounds(spec.sweep)):
            observed = [SweepObservation(
                t.params, t.val_loss if math.isfinite(t.val_loss) else None, t.distributions,
                pruned=t.status == TRIAL_PRUNED, rungs=t.rungs) for t in trials]
            plan = await workflow.execute_local_activity(
                SUGGEST_TRIALS, SuggestInput(spec.to_dict()["sweep"], observed, size, spec.seed,
                                             spec.to_dict()),
                result_type=SuggestResult, **suggest_options(),
                summary=f"sweep round {round_no}: suggest {size} points "
                        f"({spec.sweep.sampler}{', prior first' if not observed else ''})")
            sources = plan.sources or [plan.source] * len(plan.points)  # older histories
            for start in range(0, size, spec.sweep.parallel):
                first = len(trials)
                trials += await asyncio.gather(*(
                    self._trial(spec, inp.dataset_uri, first + i, plan.points[start + i],
                                round_no, sources[start + i], plan.distributions)
                    for i in range(len(plan.points[start:start + spec.sweep.parallel]))))
        # a pruned trial never wins (it stopped early: its loss is not a final one)
        finished = [t for t in trials if t.status != TRIAL_PRUNED] or trials
        best = min(finished,
                   key=lambda t: t.val_loss if math.isfinite(t.val_loss) else math.inf)
        return SweepResult(best_params=best.params, trials=trials)

    async def _trial(self, spec: RunSpec, dataset_uri: str, index: int,
                     params: dict[str, float], round_no: int, source: str,
                     distributions: dict[str, str]) -> TrialResult:
        tspec = trial_spec(spec, index, params)
        in_segment = workflow.patched(SCORED_IN_SEGMENT)
        if in_segment:
            tspec = tspec.replace(**{"train.eval_every": trial_eval_every(spec.sweep)})
        steps = tspec.train.total_steps
        shown = ", ".join(f"{k} {v:.3g}" for k, v in sorted(params.items()))
        pruned: PruneResult | None = None
        record = self._records[index] = RungRecord(TRIAL_RUNNING)
        if spec.sweep.pruning.enabled:
            steps, val_loss, pruned = await self._in_rungs(spec, tspec, dataset_uri, index,
                                                          round_no, shown, in_segment)
        else:  # one segment, its score (an evaluation, in recorded histories before the patch)
            seg = await workflow.execute_activity(
                TRAIN_SEGMENT, TrainSegmentInput(tspec.to_dict(), dataset_uri, 0, steps),
                task_queue=TRAINER_QUEUE, result_type=TrainSegmentResult,
                **segment_options(tspec),
                summary=f"sweep trial {index} (round {round_no}, {shown}): train {steps} steps")
            val_loss = await self._held_out(tspec, dataset_uri, index, steps,
                                            seg if in_segment else None)
        status = TRIAL_PRUNED if pruned and pruned.prune else \
            TRIAL_COMPLETE if math.isfinite(val_loss) else TRIAL_DIVERGED
        record.status, record.val_loss = status, val_loss if status == TRIAL_COMPLETE else None
        payload = {"params": params, "result": val_loss, "trial_run_id": tspec.run_id,
                   "round": round_no, "source": source, "steps": steps, "status": status}
        if spec.sweep.pruning.enabled:
            payload["rungs"] = record.rungs
        if pruned and pruned.prune:  # the evidence: how it stood among the trials at its rung
            payload["pruned_at"] = {"rung": pruned.rung, "step": pruned.step,
                                    "competing": pruned.competing, "better": pruned.better}
        await workflow.execute_local_activity(
            RECORD_EVENT, RecordEventInput(
                durable=spec.storage.durable, run_id=spec.run_id, kind="sweep_trial",
                event_id=f"sweep_trial/{index}", step=0, payload=payload),
            start_to_close_timeout=timedelta(seconds=60),
            summary=f"event sweep_trial/{index}: held-out loss {val_loss:.4f}"
                    + (f" (pruned at step {steps})" if status == TRIAL_PRUNED else ""))
        return TrialResult(params=params, val_loss=val_loss, run_id=tspec.run_id, source=source,
                           distributions=distributions, status=status,
                           rungs=list(record.rungs), steps=steps)

    async def _in_rungs(self, spec: RunSpec, tspec: RunSpec, dataset_uri: str, index: int,
                        round_no: int, shown: str, in_segment: bool
                        ) -> tuple[int, float, PruneResult | None]:
        """Train the trial a rung at a time, asking the pruner at each boundary but the last:
        (steps trained, the last held-out loss, the last decision)."""
        bounds = rung_steps(spec.sweep.pruning, spec.sweep.trial_steps)
        record, start, decision = self._records[index], 0, None
        for rung, end in enumerate(bounds):
            seg = await workflow.execute_activity(
                TRAIN_SEGMENT, TrainSegmentInput(tspec.to_dict(), dataset_uri, start, end),
                task_queue=TRAINER_QUEUE, result_type=TrainSegmentResult,
                **segment_options(tspec),
                summary=f"sweep trial {index} (round {round_no}, {shown}): rung {rung}, "
                        f"train steps {start}-{end}")
            val_loss = await self._held_out(tspec, dataset_uri, index, end,
                                            seg if in_segment else None)
            if end == bounds[-1]:
                break
            record.rungs.append([end, val_loss])
            order = sorted(self._records)
            decision = await workflow.execute_local_activity(
                PRUNE_TRIAL, PruneInput(spec.to_dict()["sweep"]["pruning"],
                                        spec.sweep.trial_steps,
                                        [self._records[i] for i in order], order.index(index)),
                result_type=PruneResult, **suggest_options(),
                summary=f"sweep trial {index}: prune at step {end}? held-out loss "
                        f"{val_loss:.4f}")
            if decision.prune:
                return end, val_loss, decision
            start = end
        return bounds[-1], val_loss, decision

    async def _held_out(self, tspec: RunSpec, dataset_uri: str, index: int, step: int,
                        seg: TrainSegmentResult | None = None) -> float:
        """The trial's held-out loss at `step`: its segment's online evaluation there, else
        (none in `seg`: a retry of a segment that had already finished, a rollback at that
        step; or a history from before the patch, `seg` None) the evaluate activity's."""
        scored_there = [val for at, _, val in (seg.evals if seg else []) if int(at) == step]
        if scored_there:
            return scored_there[-1]
        scored = await workflow.execute_activity(
            EVALUATE, EvaluateInput(tspec.to_dict(), dataset_uri, [step]),
            task_queue=TRAINER_QUEUE, result_type=EvaluateResult, **short_options(tspec),
            summary=f"sweep trial {index}: held-out loss at step {step}")
        return scored.results[0].val_loss
