"""A bounded teacher, and copies that fit: every rank checks the teacher's size against
`distill.max_teacher_params` before it builds the model (trainer/teacher.py), and a rank's
local copy of the teacher's or the init_from source's promoted weights checks the disk's
free space first — DiskFull naming the directory, the bytes needed and free, before a
byte is copied (trainer/init_from.py `load_promoted`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.errors import BadConfig, DiskFull
from tests.trainer.helpers import VOCAB, tiny_spec
from tests.trainer.layouts import promote_model
from trainer import teacher as teacher_module
from trainer.init_from import load_init_weights
from trainer.model import GPT
from trainer.teacher import load_teacher

CPU = torch.device("cpu")


def student(store: Path, **more):
    return tiny_spec(store, **{"run_id": "s", "model.d_model": 16, "model.n_heads": 2,
                               "model.n_kv_heads": 2, "distill.teacher": "t", **more})


def _promoted(tmp_path: Path) -> GPT:
    spec = tiny_spec(tmp_path / "store")
    model = GPT(spec.model, VOCAB, seed=7)
    promote_model(tmp_path / "store", spec, model, tmp_path)
    return model


def _claim_huge_files(store: Path, run_id: str = "t", step: int = 4) -> int:
    """The promoted manifest of `run_id` rewritten to claim a file of 2^60 bytes."""
    path = store / "runs" / run_id / "promoted" / f"step-{step:09d}" / "MANIFEST.json"
    raw = json.loads(path.read_text())
    raw["files"]["mp_rank_00_model_states.pt"]["size"] = 2**60
    path.write_text(json.dumps(raw))
    return 2**60


def test_a_teacher_over_the_limit_is_refused_on_every_rank_before_its_model_is_built(
        tmp_path, monkeypatch):
    source = _promoted(tmp_path)
    params = source.param_count()
    built: list[object] = []
    real_gpt = teacher_module.GPT

    def counting_gpt(*args, **kwargs):
        built.append(args)
        return real_gpt(*args, **kwargs)

    monkeypatch.setattr(teacher_module, "GPT", counting_gpt)
    with pytest.raises(BadConfig) as err:
        load_teacher(student(tmp_path / "store", **{"distill.max_teacher_params": params - 1}),
                     VOCAB, CPU, str(tmp_path / "w"))
    assert err.value.field == "distill.max_teacher_params" and built == []
    teacher = load_teacher(student(tmp_path / "store", **{"distill.max_teacher_params": params}),
                           VOCAB, CPU, str(tmp_path / "w"))
    assert teacher.model.param_count() == params and len(built) == 1


def test_a_teacher_copy_the_disk_cannot_hold_is_disk_full_before_a_byte_is_copied(tmp_path):
    _promoted(tmp_path)
    need = _claim_huge_files(tmp_path / "store")
    with pytest.raises(DiskFull) as err:
        load_teacher(student(tmp_path / "store"), VOCAB, CPU, str(tmp_path / "w"))
    assert err.value.need == need and err.value.free < need
    assert err.value.path == str(tmp_path / "w" / "teacher" / "rank0")
    assert not err.value.retryable
    assert list((tmp_path / "w" / "teacher" / "rank0").iterdir()) == []


def test_an_init_from_copy_the_disk_cannot_hold_is_disk_full_before_a_byte_is_copied(
        tmp_path):
    _promoted(tmp_path)
    need = _claim_huge_files(tmp_path / "store")
    child = tiny_spec(tmp_path / "store", **{"run_id": "c", "train.init_from": "t"})
    with pytest.raises(DiskFull) as err:
        load_init_weights(GPT(child.model, VOCAB, seed=1), child, str(tmp_path / "w"), rank=1)
    assert err.value.need == need and err.value.path == str(tmp_path / "w" / "init_from" /
                                                            "rank1")
    assert list((tmp_path / "w" / "init_from" / "rank1").iterdir()) == []
