"""The teacher of a student run (trainer/teacher.py): the teacher run's promoted weights,
read weights-only into its own model config, frozen and in eval mode; a pickle payload in
them is refused and never run. No DeepSpeed: a promoted checkpoint of model states is
written here as trainer.segment writes it (`{"module": state_dict}`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.errors import BadConfig, BadData
from storage.checkpoints import CheckpointStore
from storage.runs import claim_run
from tests.trainer.helpers import VOCAB, tiny_spec
from tests.trainer.test_safe_load import plant
from trainer.model import GPT
from trainer.teacher import load_teacher

MODEL = "mp_rank_00_model_states.pt"


def promote_teacher(store: Path, tmp: Path, payload=None) -> GPT:
    """Run "t" (the tiny spec) claimed, with step 4 committed and promoted; its model."""
    spec = tiny_spec(store)
    claim_run(str(store), "t", spec.spec_hash(), spec.to_dict())
    model = GPT(spec.model, VOCAB, seed=7)
    local = tmp / "ckpt"
    local.mkdir()
    if payload is None:
        torch.save({"module": model.state_dict()}, local / MODEL)
    else:
        payload(local / MODEL)
    ckpts = CheckpointStore(str(store), "t")
    ckpts.commit(4, str(local), tokens_seen=512, data_cursor=4)
    ckpts.promote(4)
    return model


def student(store: Path, teacher: str = "t"):
    return tiny_spec(store, **{"run_id": "s", "model.d_model": 16, "model.n_heads": 2,
                               "model.n_kv_heads": 2, "distill.teacher": teacher,
                               "distill.alpha": 0.3, "distill.temperature": 2.5})


def test_the_teacher_is_the_promoted_weights_frozen_in_eval_mode(tmp_path):
    source = promote_teacher(tmp_path / "store", tmp_path)
    teacher = load_teacher(student(tmp_path / "store"), VOCAB, torch.device("cpu"),
                           str(tmp_path / "w"))
    assert (teacher.run_id, teacher.step, teacher.alpha, teacher.temperature) == ("t", 4, 0.3, 2.5)
    assert teacher.model.cfg.d_model == 32  # the teacher's own config, not the student's
    mine, theirs = teacher.model.state_dict(), source.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not teacher.model.training
    assert not any(p.requires_grad for p in teacher.model.parameters())
    # the loss runs the teacher on the same rows and leaves it untouched
    x = torch.randint(0, VOCAB, (2, 32))
    logits = torch.randn(2, 32, VOCAB, requires_grad=True)
    teacher.loss(logits, x, x).backward()
    assert logits.grad is not None and teacher.forwards == 1
    cost = teacher.cost(1)
    assert cost["weight_bytes"] == 4 * source.param_count()
    assert cost["logits_bytes"] == 2 * 32 * VOCAB * 4  # one micro-batch of fp32 logits


@pytest.mark.process
def test_a_pickle_payload_in_the_teachers_files_is_refused_never_run(tmp_path):
    marker = tmp_path / "pwned"
    promote_teacher(tmp_path / "store", tmp_path, payload=lambda p: plant(p, marker, "module"))
    with pytest.raises(BadData) as err:
        load_teacher(student(tmp_path / "store"), VOCAB, torch.device("cpu"),
                     str(tmp_path / "w"))
    assert "teacher" in err.value.problem and "cannot be loaded" in err.value.problem
    assert not marker.exists()


def test_a_missing_teacher_or_another_vocabulary_is_bad_config_naming_distill_teacher(tmp_path):
    with pytest.raises(BadConfig) as err:
        load_teacher(student(tmp_path / "store"), VOCAB, torch.device("cpu"), str(tmp_path / "w"))
    assert err.value.field == "distill.teacher" and "no promoted checkpoint" in err.value.problem
    promote_teacher(tmp_path / "store", tmp_path)
    with pytest.raises(BadConfig) as err:
        load_teacher(student(tmp_path / "store"), VOCAB * 2, torch.device("cpu"),
                     str(tmp_path / "w"))
    assert err.value.field == "distill.teacher" and "does not fit" in err.value.problem
