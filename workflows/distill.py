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

A child that fails (or is aborted or terminated by an operator) is the child's outcome:
the stage records it beside the teacher's and the teacher's run completes, promoted, as
it was before the stage began. A child's failure never becomes its parent's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ChildWorkflowError
from temporalio.workflow import ChildWorkflowHandle

with workflow.unsafe.imports_passed_through():
    from activities.contracts import WORKFLOW_TYPE, RunResult
    from spec import RunSpec
    from spec.distill import BASELINE_SUFFIX, STUDENT_SUFFIX, student_spec


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


async def run_child(s: RunSpec, teacher_step: int, wait: Callable[[Any], Awaitable[Any]], *,
                    baseline: bool) -> tuple[RunResult | None, str]:
    """(its result, "") or, where the child run failed, (None, why): a child's failure is
    recorded, not raised into the teacher's run. An abort of the teacher still ends it
    (`wait` raises RunAborted, not a child's error). Histories from before this rule
    replay as they ran (the teacher failed with its child)."""
    try:
        return await wait(await start_student(s, teacher_step, baseline=baseline)), ""
    except ChildWorkflowError as err:
        if not workflow.patched("distill_child_failure_kept"):
            raise
        return None, root_cause(err)


def root_cause(err: BaseException) -> str:
    """The innermost failure of a child's error chain (the activity's own error, where
    its run failed on one), as "Type: message", bounded for the stage's record."""
    while getattr(err, "cause", None) is not None:
        err = err.cause  # type: ignore[attr-defined]
    kind = getattr(err, "type", None) or type(err).__name__
    return f"{kind}: {getattr(err, 'message', None) or err}"[:500]


def child_record(prefix: str, child_id: str, result: RunResult | None, error: str) -> dict:
    """The stage's fields for one child run: its id, outcome and held-out loss."""
    return {f"{prefix}_run": child_id,
            f"{prefix}_status": "completed" if result is not None else "failed",
            f"{prefix}_val_loss": result.final_val_loss if result is not None else None,
            **({f"{prefix}_error": error} if error else {})}


async def distill(s: RunSpec, teacher_step: int, teacher_val_loss: float,
                  wait: Callable[[Any], Awaitable[Any]]) -> dict[str, Any]:
    """Train the student (then its baseline) to the end; the stage's record: each run's
    held-out loss beside the teacher's (or that it failed, and why), where the student was
    promoted, and the wall time each took. `wait`: the run's await-unless-aborted."""
    began = workflow.now()
    student, error = await run_child(s, teacher_step, wait, baseline=False)
    student_s = (workflow.now() - began).total_seconds()
    out: dict[str, Any] = {
        "teacher_step": teacher_step, "teacher_val_loss": teacher_val_loss,
        **child_record("student", s.run_id + STUDENT_SUFFIX, student, error),
        "student_promoted": student.promoted_checkpoint if student else None,
        "steps": student.final_step if student else None,
        "alpha": s.distill.alpha, "temperature": s.distill.temperature,
        "student_wall_s": round(student_s, 1)}
    if s.distill.baseline:
        began = workflow.now()
        base, error = await run_child(s, teacher_step, wait, baseline=True)
        out.update(child_record("baseline", s.run_id + BASELINE_SUFFIX, base, error),
                   baseline_wall_s=round((workflow.now() - began).total_seconds(), 1))
    return out
