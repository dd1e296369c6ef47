"""The distill stage on the real Temporal dev server with stub activities (stub_run.py):
after promotion the student, then its no-teacher baseline, train as TrainingRun children of
their own, each promoted in its own run; the stage records both beside the teacher. A run
without `distill` ends at promotion as before (test_training_run_stubs.py)."""

from __future__ import annotations

import asyncio
import uuid

from temporalio import activity
from temporalio.client import Client

from activities.contracts import EVALUATE, STAGES, EvalPoint, EvaluateInput, EvaluateResult
from tests.workflows.stub_run import Harness, Stubs, spec_for

# the held-out loss each run's last step reaches in these stubs
LOSS = {"": 3.8, "-student": 4.1, "-student-base": 4.4}


class DistillStubs(Stubs):
    @activity.defn(name=EVALUATE)
    async def evaluate(self, inp: EvaluateInput) -> EvaluateResult:
        run = inp.spec["run_id"]
        suffix = next(k for k in sorted(LOSS, key=len, reverse=True) if run.endswith(k))
        return EvaluateResult([EvalPoint(s, 5.0 if s == 0 else LOSS[suffix], 0.0)
                               for s in inp.steps])


def test_the_student_and_its_baseline_train_as_runs_of_their_own_and_are_promoted_beside(
        temporal_server):
    async def go() -> None:
        client = await Client.connect(temporal_server.address)
        async with Harness(client, DistillStubs()) as h:
            run_id = f"stub-distill-{uuid.uuid4().hex[:6]}"
            spec = spec_for(run_id, **{"train.total_steps": 10, "distill.enabled": True,
                                       "distill.alpha": 0.7})
            handle = await h.start(spec)
            result = await asyncio.wait_for(handle.result(), 60)
            await h.record("distill", run_id, f"{run_id}-student", f"{run_id}-student-base")

            assert result["status"] == "completed"
            assert result["stages"] == [*STAGES, "distill"]
            assert result["final_val_loss"] == 3.8  # the teacher's: the run is still its own
            assert result["promoted_checkpoint"].endswith("step-000000010")
            d = result["distilled"]
            assert (d["student_run"], d["baseline_run"]) == (f"{run_id}-student",
                                                            f"{run_id}-student-base")
            assert (d["teacher_val_loss"], d["student_val_loss"], d["baseline_val_loss"]) == \
                (3.8, 4.1, 4.4)
            assert (d["teacher_step"], d["steps"], d["alpha"]) == (10, 10, 0.7)
            # each run's segment, in order: the teacher's, the student's, its baseline's
            runs = [(s.spec["run_id"], s.from_step, s.to_step) for s in h.stubs.segments]
            assert runs == [(run_id, 0, 10), (f"{run_id}-student", 0, 10),
                            (f"{run_id}-student-base", 0, 10)]
            student, base = h.stubs.segments[1].spec, h.stubs.segments[2].spec
            assert student["distill"]["teacher"] == f"{run_id}@10"
            assert student["distill"]["alpha"] == 0.7 and base["distill"]["teacher"] == ""
            assert student["model"] == base["model"] == spec.to_dict()["distill"]["student"]
            # each child claimed its own id and promoted in its own run
            assert [c.run_id for c in h.stubs.claims] == \
                [run_id, f"{run_id}-student", f"{run_id}-student-base"]
            finished = [p for p in h.stubs.payloads("stage_finished") if p["stage"] == "distill"]
            assert len(finished) == 1 and finished[0]["student_val_loss"] == 4.1
            status = await h.status(handle)
            assert status["stage"] == "completed"
    asyncio.run(go())
