"""`distill.teacher` checked before any accelerator is used (storage/teacher_source.py): the
teacher run's promoted checkpoint and stored spec exist, and it read this run's tokens —
else a BadConfig naming distill.teacher and the fix. Its model may differ (it is the
teacher, not the student's starting point)."""

from __future__ import annotations

import pytest

from common.errors import BadConfig
from spec import RunSpec
from storage.dataset import load_manifest
from storage.teacher_source import check_teacher
from tests.storage.source_runs import MODEL, SOURCE_HASH, dataset, source_store


@pytest.fixture
def store(tmp_path) -> str:
    """Run `base` (MODEL, tokenizer A) with steps 4 and 8 promoted."""
    return source_store(tmp_path)


def student(url: str, teacher: str = "base") -> RunSpec:
    return RunSpec.from_dict({"run_id": "student", "model": {**MODEL, "d_model": 16},
                              "train": {"micro_batch_tokens": 128},
                              "distill": {"teacher": teacher}, "storage": {"durable": url}})


def test_a_teacher_with_this_tokenizer_fits_whatever_its_model(store, tmp_path):
    same = dataset(tmp_path / "data-b", "tokenizer A")
    source = check_teacher(student(store), same, load_manifest(same))
    assert (source.run_id, source.step) == ("base", 8)
    assert check_teacher(student(store, "base@4"), same, load_manifest(same)).step == 4


def test_a_teacher_of_another_tokenizer_is_refused_naming_its_tokenizer(store, tmp_path):
    other = dataset(tmp_path / "data-c", "tokenizer B")
    with pytest.raises(BadConfig) as err:
        check_teacher(student(store), other, load_manifest(other))
    assert err.value.field == "distill.teacher" and "another tokenizer" in err.value.problem
    assert f"datasets/{SOURCE_HASH}/tokenizer.json" in err.value.fix


def test_a_missing_teacher_or_step_is_refused_naming_distill_teacher(store, tmp_path):
    same = dataset(tmp_path / "data-b", "tokenizer A")
    for teacher, words in (("nobody", "no promoted checkpoint"), ("base@6", "at step 6")):
        with pytest.raises(BadConfig) as err:
            check_teacher(student(store, teacher), same, load_manifest(same))
        assert err.value.field == "distill.teacher" and words in err.value.problem
