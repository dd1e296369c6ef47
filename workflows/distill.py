"""The distill stage (spec/distill.py), after promotion: the student, and with
`distill.baseline` the same student without a teacher, each trained as a run of its own — a
TrainingRun child on the run's own queue, named after its run id (`<run_id>-student`,
`<run_id>-student-base`), so its segments go through the same supervisor, checkpoints,
faults, spike handling, evaluation and promotion as any run, and an operator addresses it
by that id like any run. Each child promotes into its own run's `promoted/`, beside the
teacher's, never over it. Workflow code: deterministic, no I/O.

The two children run one after the other: on a fleet with one trainer they would queue
for it anyway (a node runs one training job at a time), and a student ahead of its
baseline is the result that matters first.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import workflow
from temporalio.workflow import ChildWorkflowHandle

with workflow.unsafe.imports_passed_through():
    from activities.contracts import WORKFLOW_TYPE, RunResult
    from spec import RunSpec
    from spec.distill import student_spec


async def start_student(s: RunSpec, teacher_step: int, *, baseline: bool
                        ) -> ChildWorkflowHandle[Any, RunResult]:
    spec = student_spec(s.to_dict(), teacher_step, baseline=baseline)
    d = s.distill
    what = ("the same student without a teacher" if baseline else
            f"student of {s.run_id}@{teacher_step}, alpha {d.alpha:g}, T {d.temperature:g}")
    return await workflow.start_child_workflow(
        WORKFLOW_TYPE, spec, id=spec["run_id"],
        task_queue=workflow.info().task_queue, result_type=RunResult,
        static_summary=f"distill: {what}, {spec['train']['total_steps']} steps")


async def distill(s: RunSpec, teacher_step: int, teacher_val_loss: float,
                  wait: Callable[[Any], Awaitable[Any]]) -> dict[str, Any]:
    """Train the student (then its baseline) to the end; the stage's record: each run's
    held-out loss beside the teacher's, where the student was promoted, and the wall time
    each took. `wait`: the run's await-unless-aborted."""
    began = workflow.now()
    student: RunResult = await wait(await start_student(s, teacher_step, baseline=False))
    student_s = (workflow.now() - began).total_seconds()
    out: dict[str, Any] = {
        "teacher_step": teacher_step, "teacher_val_loss": teacher_val_loss,
        "student_run": student.run_id, "student_val_loss": student.final_val_loss,
        "student_promoted": student.promoted_checkpoint, "steps": student.final_step,
        "alpha": s.distill.alpha, "temperature": s.distill.temperature,
        "student_wall_s": round(student_s, 1)}
    if s.distill.baseline:
        began = workflow.now()
        base: RunResult = await wait(await start_student(s, teacher_step, baseline=True))
        out.update(baseline_run=base.run_id, baseline_val_loss=base.final_val_loss,
                   baseline_wall_s=round((workflow.now() - began).total_seconds(), 1))
    return out
