"""A student run that fails is the student's outcome, never its teacher's: on the real
Temporal dev server with stub activities (stub_run.py), the teacher's run, promoted before
the distill stage began, completes with the stage recording that its student failed and
why; the baseline still trains and is compared with the teacher."""

from __future__ import annotations

import asyncio
import uuid

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.contracts import (
    EVALUATE,
    TRAIN_SEGMENT,
    EvalPoint,
    EvaluateInput,
    EvaluateResult,
    TrainSegmentInput,
    TrainSegmentResult,
)
from tests.workflows.stub_run import Harness, Stubs, spec_for


class FailingStudent(Stubs):
    """The student's segment fails as a deterministic error does (not retried); the
    teacher and the baseline train as in test_distill_stage.py."""

    @activity.defn(name=TRAIN_SEGMENT)
    async def train_segment(self, inp: TrainSegmentInput) -> TrainSegmentResult:
        if inp.spec["run_id"].endswith("-student"):
            raise ApplicationError("the student's loss is NaN from step 1", type="Diverged",
                                   non_retryable=True)
        return await Stubs.train_segment(self, inp)

    @activity.defn(name=EVALUATE)
    async def evaluate(self, inp: EvaluateInput) -> EvaluateResult:
        loss = 4.4 if inp.spec["run_id"].endswith("-student-base") else 3.8
        return EvaluateResult([EvalPoint(s, 5.0 if s == 0 else loss, 0.0) for s in inp.steps])


def test_a_failed_student_leaves_its_promoted_teacher_run_completed(temporal_server):
    async def go() -> None:
        client = await Client.connect(temporal_server.address)
        async with Harness(client, FailingStudent()) as h:
            run_id = f"stub-dfail-{uuid.uuid4().hex[:6]}"
            spec = spec_for(run_id, **{"train.total_steps": 10, "distill.enabled": True})
            result = await asyncio.wait_for((await h.start(spec)).result(), 60)

            assert result["status"] == "completed"  # the teacher's run, as promoted
            assert result["promoted_checkpoint"].endswith("step-000000010")
            assert result["final_val_loss"] == 3.8
            d = result["distilled"]
            assert d["student_run"] == f"{run_id}-student"
            assert d["student_status"] == "failed" and d["student_val_loss"] is None
            assert d["student_error"] == "Diverged: the student's loss is NaN from step 1"
            assert d["student_promoted"] is None
            # the baseline is a run of its own: it still trains, beside the teacher
            assert (d["baseline_status"], d["baseline_val_loss"]) == ("completed", 4.4)
            finished = h.stubs.payloads("run_finished")
            assert finished and finished[-1]["status"] == "completed"
            stage = [p for p in h.stubs.payloads("stage_finished") if p["stage"] == "distill"]
            assert len(stage) == 1 and stage[0]["student_status"] == "failed"
            assert (await h.status(h.client.get_workflow_handle(run_id)))["stage"] == \
                "completed"
            student = await client.get_workflow_handle(f"{run_id}-student").describe()
            assert student.status.name == "FAILED"  # the child's own outcome stays its own
    asyncio.run(go())
