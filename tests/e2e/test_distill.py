"""The distill stage end to end: real Temporal, real workers, real DeepSpeed. A run trains
its teacher, promotes it, then trains a student and its no-teacher baseline as runs of their
own; the trainer worker is SIGKILLed during the student's segment and the student resumes
from its last commit. Soak: three runs' training (a few minutes on two cores); the
bitwise-exact resume of a student segment is tests/trainer/test_distill_segment.py's."""

from __future__ import annotations

import pytest

from spec import RunSpec
from spec.distill import student_spec
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.e2e.runs import chaos_for, run_in_background, strike, tiny_spec, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.soak]


def test_a_run_distils_a_student_that_survives_a_kill_and_is_promoted_beside_its_teacher(
        temporal_server, fleet_factory, tmp_path):
    spec = tiny_spec("e2e-distill", str(tmp_path / "store"), str(tmp_path / "fast"), **{
        "train.total_steps": 40, "train.segment_steps": 40, "sweep.enabled": False,
        "distill.enabled": True, "distill.steps": 40, "distill.alpha": 0.5,
        "distill.student": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                            "seq_len": 64}})
    student = RunSpec.from_dict(student_spec(spec.to_dict(), 40))
    fleet = fleet_factory(restart=True)
    runner, box = run_in_background(temporal_server.address, spec)
    strike(chaos_for(fleet, student), student, "kill_worker", (0, 40), (15, 30), timeout_s=400)
    runner.join(900)
    assert "result" in box, box
    result = box["result"]

    assert result["status"] == "completed" and result["stages"][-1] == "distill"
    d = result["distilled"]
    assert d["student_run"] == "e2e-distill-student" and d["steps"] == 40
    # the student learned (from a loss near ln(512) = 6.2) and both students are measured
    assert d["student_val_loss"] < 5.5 and d["baseline_val_loss"] < 6.5
    # each promoted in its own run, the teacher's promotion untouched
    teacher = CheckpointStore(spec.storage.durable, spec.run_id)
    assert teacher.list_promoted() == [40]
    assert CheckpointStore(spec.storage.durable, student.run_id).list_promoted()
    assert "e2e-distill-student/promoted" in d["student_promoted"]
    # the kill and the recovery are in the student's own record, with the teacher's cost
    events = read_events(spec.storage.durable, student.run_id)
    kinds = [e["kind"] for e in events]
    assert "recovered" in kinds and "teacher_cost" in kinds
    # its teacher was checked on the data worker before any accelerator, and is its lineage
    [lineage] = [e["payload"] for e in events if e["kind"] == "distilled_from"]
    assert (lineage["source_run"], lineage["source_step"]) == (spec.run_id, 40)
    assert fleet.restarts == {"trainer": 1}
    assert wait_for(lambda: read_events(spec.storage.durable, spec.run_id,
                                        kinds=("stage_finished",)), 5, "the stage records")
