"""Sweep: the warm-up hyperparameter sweep as a child workflow.

Each round asks optuna's sampler (sweep/suggest.py: TPE, multivariate with constant liar, or
GP; spec sweep.sampler) for its points, given every trial so far; trial 0 is the scaling-law
prior (sweep/prior.py: Step Law's learning rate). The suggester runs as the `suggest_trials`
local activity: no CPU work and no optuna here, each round's points (with their
distributions) are in the history, and this workflow's trials are the study's only record,
rebuilt by the activity on every call.
Each trial is a short run of its own (own run id and checkpoints) trained by the same
train_segment activity and scored by held-out loss; the lowest finite loss wins. Its
`sweep_trial` event carries its point, source, steps, status and loss: what `mainspring
sweep RUN` (ops/cli_sweep.py) prints. Adding payload keys changes no command, so recorded
histories replay as they were.
"""

from __future__ import annotations

import asyncio
import math
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.contracts import (
        EVALUATE,
        RECORD_EVENT,
        SUGGEST_TRIALS,
        SWEEP_WORKFLOW_TYPE,
        TRAIN_SEGMENT,
        TRAINER_QUEUE,
        EvaluateInput,
        EvaluateResult,
        RecordEventInput,
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
    from workflows.activity_options import segment_options, short_options, suggest_options
    from workflows.failures import FAILURE_EXCEPTION_TYPES
    from workflows.sweep_plan import sweep_rounds, trial_spec


@workflow.defn(name=SWEEP_WORKFLOW_TYPE, failure_exception_types=FAILURE_EXCEPTION_TYPES)
class Sweep:
    @workflow.run
    async def run(self, inp: SweepInput) -> SweepResult:
        spec = RunSpec.from_dict(inp.spec)
        trials: list[TrialResult] = []
        for round_no, size in enumerate(sweep_rounds(spec.sweep)):
            observed = [SweepObservation(
                t.params, t.val_loss if math.isfinite(t.val_loss) else None, t.distributions)
                for t in trials]
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
        best = min(trials, key=lambda t: t.val_loss if math.isfinite(t.val_loss) else math.inf)
        return SweepResult(best_params=best.params, trials=trials)

    async def _trial(self, spec: RunSpec, dataset_uri: str, index: int,
                     params: dict[str, float], round_no: int, source: str,
                     distributions: dict[str, str]) -> TrialResult:
        tspec = trial_spec(spec, index, params)
        steps = tspec.train.total_steps
        shown = ", ".join(f"{k} {v:.3g}" for k, v in sorted(params.items()))
        await workflow.execute_activity(
            TRAIN_SEGMENT, TrainSegmentInput(tspec.to_dict(), dataset_uri, 0, steps),
            task_queue=TRAINER_QUEUE, result_type=TrainSegmentResult, **segment_options(tspec),
            summary=f"sweep trial {index} (round {round_no}, {shown}): train {steps} steps")
        scored = await workflow.execute_activity(
            EVALUATE, EvaluateInput(tspec.to_dict(), dataset_uri, [steps]),
            task_queue=TRAINER_QUEUE, result_type=EvaluateResult, **short_options(tspec),
            summary=f"sweep trial {index}: held-out loss at step {steps}")
        val_loss = scored.results[0].val_loss
        await workflow.execute_local_activity(
            RECORD_EVENT, RecordEventInput(
                durable=spec.storage.durable, run_id=spec.run_id, kind="sweep_trial",
                event_id=f"sweep_trial/{index}", step=0,
                payload={"params": params, "result": val_loss, "trial_run_id": tspec.run_id,
                         "round": round_no, "source": source, "steps": steps,
                         "status": "complete" if math.isfinite(val_loss) else "diverged"}),
            start_to_close_timeout=timedelta(seconds=60),
            summary=f"event sweep_trial/{index}: held-out loss {val_loss:.4f}")
        return TrialResult(params=params, val_loss=val_loss, run_id=tspec.run_id, source=source,
                           distributions=distributions)
