"""A student run's segments (`distill.teacher`) as the supervisor runs them: real torchrun,
real DeepSpeed (CPU). The teacher is a trained run's promoted checkpoint; the student trains
against it, resumes bitwise exactly after a stop, and records what the teacher cost.
At world size 2 under ZeRO 2 too (each rank loads its own teacher). Soak: nine segment
launches (about two minutes on two cores)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from storage.checkpoints import CheckpointStore
from storage.events import read_events
from storage.runs import claim_run
from tests.trainer.helpers import run_segment, tiny_spec, write_spec
from tests.trainer.test_segment import load_tensors, ok, read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

STUDENT = {"model.d_model": 16, "model.n_heads": 2, "model.n_kv_heads": 2}


def student_spec(store: Path, run_id: str, teacher: str = "t@8"):
    return tiny_spec(store, **{**STUDENT, "run_id": run_id, "distill.teacher": teacher,
                               "distill.alpha": 0.5, "distill.temperature": 2.0})


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dataset_uri) -> tuple[Path, Path]:
    """Teacher "t": 8 steps, promoted. Students (two stores): "a" 0 -> 8 in one launch; "b"
    0 -> 4, then a new process 4 -> 8. A no-teacher student "n" in store a, 0 -> 8."""
    root = tmp_path_factory.mktemp("distill")
    a, b = root / "a", root / "b"
    teacher = tiny_spec(a)
    claim_run(str(a), "t", teacher.spec_hash(), teacher.to_dict())  # the student reads it
    ok(run_segment(write_spec(teacher, root / "t.json"), dataset_uri, 8, root / "wt"))
    CheckpointStore(str(a), "t").promote(8)
    shutil.copytree(a / "runs" / "t", b / "runs" / "t")  # the same teacher in store b
    ok(run_segment(write_spec(student_spec(a, "s"), root / "sa.json"), dataset_uri, 8,
                   root / "wa"))
    spec_b = write_spec(student_spec(b, "s"), root / "sb.json")
    ok(run_segment(spec_b, dataset_uri, 4, root / "wb1"))
    ok(run_segment(spec_b, dataset_uri, 8, root / "wb2", attempt=2))
    plain = tiny_spec(a, **{**STUDENT, "run_id": "n"})
    ok(run_segment(write_spec(plain, root / "n.json"), dataset_uri, 8, root / "wn"))
    return root, a


def test_a_resumed_student_segment_is_bitwise_equal_to_an_uninterrupted_one(runs):
    root, a = runs
    b = root / "b"
    step8 = "runs/s/checkpoints/step-000000008"
    names = sorted(p.name for p in (a / step8).glob("*.pt"))
    assert "mp_rank_00_model_states.pt" in names
    for name in names:
        ta, tb = load_tensors(a / step8 / name), load_tensors(b / step8 / name)
        assert ta.keys() == tb.keys() and ta
        assert [k for k in ta if not torch.equal(ta[k], tb[k])] == [], name
    last = [[p for p in read_jsonl(root / w / "progress.jsonl") if p["type"] == "step"][-1]
            for w in ("wa", "wb2")]
    assert last[0]["loss"] == last[1]["loss"]
    resumed = json.loads((root / "wb2" / "result.json").read_text())
    assert resumed["resumed_from"] == 4 and resumed["steps_run"] == 4


def test_the_teacher_changes_the_students_loss_and_its_cost_is_recorded(runs):
    root, a = runs
    taught = [p["loss"] for p in read_jsonl(root / "wa" / "progress.jsonl") if p["type"] == "step"]
    plain = [p["loss"] for p in read_jsonl(root / "wn" / "progress.jsonl") if p["type"] == "step"]
    assert len(taught) == len(plain) == 8
    assert taught[0] != plain[0]  # the distillation loss, not the plain cross-entropy
    costs = read_events(str(a), "s", kinds=("teacher_cost",))
    assert len(costs) == 1
    payload = costs[0]["payload"]
    assert payload["teacher"] == "t@8" and payload["steps"] == 8
    assert payload["forward_s_per_step"] > 0 and payload["weight_bytes"] > 0
    assert payload["logits_bytes"] == 128 * 512 * 4  # a micro-batch of 128 tokens, fp32


def test_a_student_at_world_two_zero_two_resumes_bitwise_equal(runs, tmp_path, dataset_uri):
    root, a = runs
    over = {"train.procs_per_node": 2, "train.zero_stage": 2}
    stores = {}
    for name, plan in (("straight", ((8, 1),)), ("resumed", ((4, 1), (8, 2)))):
        store = tmp_path / name
        shutil.copytree(a / "runs" / "t", store / "runs" / "t")  # the promoted teacher
        spec = write_spec(student_spec(store, "s2").replace(**over), tmp_path / f"{name}.json")
        for to_step, attempt in plan:
            ok(run_segment(spec, dataset_uri, to_step, tmp_path / f"w-{name}-{to_step}",
                           world=2, attempt=attempt))
        stores[name] = store / "runs/s2/checkpoints/step-000000008"
    names = sorted(p.name for p in stores["straight"].glob("*.pt"))
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in names
    for name in names:
        ta, tb = load_tensors(stores["straight"] / name), load_tensors(stores["resumed"] / name)
        assert ta.keys() == tb.keys() and ta
        assert [k for k in ta if not torch.equal(ta[k], tb[k])] == [], name
