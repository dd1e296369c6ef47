"""`distill`: the optional stage that trains a student from the promoted teacher. Off by
default, out of every existing spec's hash at its defaults, each error naming the field and
the fix; the student runs the stage derives are valid specs."""

from __future__ import annotations

import dataclasses

import pytest

from spec import RunSpec
from spec.codec import value_range
from spec.distill import DistillConfig, default_dict, student_spec
from tests.spec.helpers import demo as _demo
from tests.spec.helpers import pinned
from tests.spec.helpers import refused as _error


def test_the_section_is_off_by_default_and_keeps_the_demo_hash_until_set():
    demo = RunSpec.from_dict(_demo())
    assert demo.spec_hash() == "c8357bb19b1b4caf"  # measured before distill existed
    assert demo.distill == DistillConfig() and not demo.distill.enabled
    for field, value in [("enabled", True), ("alpha", 0.9), ("temperature", 4.0),
                         ("steps", 40), ("baseline", False), ("student.d_model", 32)]:
        changed = demo.replace(**{f"distill.{field}": value})
        assert changed.spec_hash() != demo.spec_hash(), field


def test_the_added_default_is_the_sections_default():
    assert RunSpec.ADDED["distill"] == default_dict()
    assert RunSpec.from_dict({**_demo(), "distill": default_dict()}).spec_hash() == \
        "c8357bb19b1b4caf"


@pytest.mark.parametrize("over, field, words", [
    ({"distill.alpha": 1.5}, "distill.alpha", "[0, 1]"),
    ({"distill.temperature": 0.0}, "distill.temperature", "[0.05, 100]"),
    ({"distill.teacher": "Not A Run"}, "distill.teacher", "RUN_ID@STEP"),
    ({"distill.teacher": "demo@4"}, "distill.teacher", "names this run itself"),
    ({"distill.teacher": "base", "distill.enabled": True}, "distill.enabled", "student run"),
    ({"distill.enabled": True, "distill.student.seq_len": 64}, "distill.student.seq_len",
     "model.seq_len is 128"),
    ({"distill.enabled": True, "distill.student.d_model": 30}, "distill.student.d_model",
     "divisible"),
    ({"distill.enabled": True, "distill.steps": 5}, "distill.steps", "warmup_steps"),
    ({"distill.enabled": True, "run_id": "r" * 60}, "distill.enabled", "63 characters"),
    ({"distill.studnet": {}}, "distill.studnet", "unknown field"),
])
def test_a_bad_distill_setting_is_bad_config_naming_its_field(over, field, words):
    err = _error(_demo(**over))
    assert err.field == field and words in str(err), err
    assert err.fix


def test_the_student_runs_are_valid_specs_of_their_own():
    s = pinned(**{"distill.enabled": True, "distill.steps": 40, "distill.alpha": 0.7})
    student = RunSpec.from_dict(student_spec(s.to_dict(), 160))
    base = RunSpec.from_dict(student_spec(s.to_dict(), 160, baseline=True))
    assert (student.run_id, base.run_id) == ("demo-student", "demo-student-base")
    assert student.distill.teacher == "demo@160" and base.distill.teacher == ""
    assert (student.distill.alpha, student.distill.temperature) == (0.7, 2.0)
    assert student.model == base.model == s.distill.student
    assert student.train.total_steps == base.train.total_steps == 40
    assert not student.sweep.enabled and student.faults == () and not student.distill.enabled
    # the same data section: the stage's data prep is the teacher's, from the cache
    assert student.data == base.data == s.data
    # steps 0: the teacher's own
    whole = pinned(**{"distill.enabled": True})
    assert RunSpec.from_dict(student_spec(whole.to_dict(), 1)).train.total_steps == 160


def test_every_numeric_field_declares_a_range_holding_its_default():
    numeric = [f for f in dataclasses.fields(DistillConfig) if f.type in ("int", "float")]
    assert len(numeric) == 4  # alpha, temperature, steps, max_teacher_params
    for f in numeric:
        lo, hi = value_range(f)
        assert lo <= f.default <= hi, f.name
