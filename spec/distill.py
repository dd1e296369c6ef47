"""RunSpec's `distill` section: an optional stage after promotion that trains a small student
from the run's promoted checkpoint as a frozen teacher (trainer/distill.py holds the loss,
trainer/teacher.py loads the teacher, workflows/distill.py runs the stage). Stdlib only;
not re-exported by spec (`from spec.distill import DistillConfig`).

The stage trains the student as a run of its own, `<run_id>-student`, through the same
workflow, supervisor and checkpoints as any run; its spec is this run's with the student's
model, `distill.steps` steps, no sweep, no injected faults and `distill.teacher` naming the
promoted step (`student_spec`). With `baseline`, a second run `<run_id>-student-base`, the
same student without a teacher, trains the same steps on the same data for comparison.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from spec.codec import STEPS, num
from spec.codec import require as _require
from spec.model import ModelConfig
from spec.train import INIT_FROM_RE

STUDENT_SUFFIX = "-student"
BASELINE_SUFFIX = "-student-base"
# the longest run id whose students' ids are still run ids (spec/run.py: at most 63)
MAX_TEACHER_RUN_ID = 63 - len(BASELINE_SUFFIX)
# The coldest temperature: at T = 0.05 a logit gap of 1 becomes a probability ratio of
# e^-20 = 2e-9, below fp32's resolution next to 1 (2^-24 = 6e-8), so the softened teacher
# is already one-hot for every gap of a logit or more; colder carries no more of it, only
# scales logits / T towards overflow (T = 1e-300: 1 / T is inf in fp32, every loss NaN)
# and T^2 towards underflow (1e-600 is 0). At 0.05, logits / T stay finite in fp32 for any
# logit below 1.7e37 and T^2 = 0.0025. Hinton et al. (2015) distil at T in [1, 20].
MIN_TEMPERATURE = 0.05


def default_student() -> ModelConfig:
    """Half the demo's width: a student is meant to be smaller than its teacher."""
    return ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4)


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    # Run the distill stage after promotion (off: the run ends at promotion, as before).
    enabled: bool = False
    # The student's model. seq_len must be the teacher's (model.seq_len): both read the
    # same rows; the vocabulary is the dataset's, the same for both.
    student: ModelConfig = field(default_factory=default_student)
    # L = (1 - alpha) CE + alpha T^2 KL(teacher_T || student_T); alpha 0 is plain training.
    alpha: float = num(0.5, 0, 1)
    # T: softens both distributions; at least MIN_TEMPERATURE (why: there)
    temperature: float = num(2.0, MIN_TEMPERATURE, 100,
                             why="a colder teacher is one-hot already in fp32")
    # The student's optimizer steps (0: train.total_steps, the teacher's own).
    steps: int = num(0, 0, STEPS)
    # Also train the same student without a teacher for the same steps: the comparison the
    # stage reports (it costs a second student's training).
    baseline: bool = True
    # This run *is* a student: the promoted checkpoint it learns from, "RUN_ID" (its newest
    # promoted step) or "RUN_ID@STEP" in the same durable store. Set by the stage on the
    # student's run; a user may set it to distil from any finished run. "": no teacher.
    teacher: str = ""
    # The largest teacher accepted, in parameters (spec/model.py param_count of the teacher
    # run's stored model section and this dataset's vocabulary). The teacher's shape is the
    # bucket's word (its RUN.json), so it is checked on the data worker before any rank
    # builds it (storage/teacher_source.py): every rank holds a whole fp32 copy, 4 bytes a
    # parameter, on the host while it loads and then on its device. 4e9: 16 GB a rank.
    max_teacher_params: int = num(4_000_000_000, 1, 10**12)

    def __post_init__(self) -> None:
        _require(self.temperature >= MIN_TEMPERATURE, "temperature",
                 f"must be at least {MIN_TEMPERATURE} (colder is one-hot already in fp32, "
                 f"and overflows), got {self.temperature}",
                 "use a temperature such as 1.0 or 2.0")
        if self.teacher:
            teacher_source(self.teacher)
            _require(not self.enabled, "enabled", "a student run does not run a distill stage "
                     "of its own", "set distill.enabled false where distill.teacher is set")

    @property
    def has_teacher(self) -> bool:
        return bool(self.teacher)


def teacher_source(text: str) -> tuple[str, int | None]:
    """Pure: `distill.teacher` as (run id, step or None: its newest promoted step)."""
    m = INIT_FROM_RE.fullmatch(text)
    _require(m is not None, "teacher", f"{text[:80]!r} is not RUN_ID or RUN_ID@STEP",
             'name a finished run of this durable store, e.g. "base-run" or "base-run@4000"')
    assert m is not None
    return m.group(1), int(m.group(2)) if m.group(2) else None


def default_dict() -> dict[str, Any]:
    """The section at its defaults, as JSON: left out of spec_hash while equal (spec/run.py)."""
    return json.loads(json.dumps(dataclasses.asdict(DistillConfig())))


def student_spec(spec: dict[str, Any], teacher_step: int, *, baseline: bool = False
                 ) -> dict[str, Any]:
    """Pure: the student's run spec (a JSON object) from this run's (`RunSpec.to_dict()`)
    and the promoted step it learns from; `baseline`: the same student with no teacher."""
    d = spec["distill"]
    run_id = spec["run_id"] + (BASELINE_SUFFIX if baseline else STUDENT_SUFFIX)
    train = {**spec["train"], "total_steps": d["steps"] or spec["train"]["total_steps"],
             "init_from": ""}
    distill = default_dict() if baseline else {
        **default_dict(), "alpha": d["alpha"], "temperature": d["temperature"],
        "teacher": f"{spec['run_id']}@{teacher_step}"}
    return {**spec, "run_id": run_id, "model": d["student"], "train": train,
            "sweep": {**spec["sweep"], "enabled": False}, "faults": [], "distill": distill}
