"""The teacher's size is the bucket's word (its run's RUN.json), so it is bounded: on the data
worker, before any rank builds it, the parameter count of the stored model with this
dataset's vocabulary must be within `distill.max_teacher_params`, and the stored section
must read as a model section (storage/teacher_source.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import BadConfig
from spec import RunSpec
from storage.dataset import load_manifest
from storage.teacher_source import check_teacher
from tests.storage.source_runs import MODEL, dataset, source_store

# spec/model.py param_count of MODEL with the source's vocabulary of 512
SOURCE_PARAMS = 47_264


def student(url: str, limit: int | None = None) -> RunSpec:
    distill = {"teacher": "base"} | ({} if limit is None else {"max_teacher_params": limit})
    return RunSpec.from_dict({"run_id": "student", "model": {**MODEL, "d_model": 16},
                              "train": {"micro_batch_tokens": 128}, "distill": distill,
                              "storage": {"durable": url}})


def test_a_teacher_over_max_teacher_params_is_refused_naming_the_limit(tmp_path):
    store = source_store(tmp_path)
    ours = dataset(tmp_path / "ours", "tokenizer A")
    assert check_teacher(student(store, SOURCE_PARAMS), ours, load_manifest(ours)).step == 8
    with pytest.raises(BadConfig) as err:
        check_teacher(student(store, SOURCE_PARAMS - 1), ours, load_manifest(ours))
    assert err.value.field == "distill.max_teacher_params"
    assert f"{SOURCE_PARAMS:,} parameters" in err.value.problem and "run base" in err.value.problem
    assert str(SOURCE_PARAMS) in err.value.fix


def test_a_stored_teacher_model_of_a_trillion_parameters_is_refused_at_the_default_limit(
        tmp_path):
    store = source_store(tmp_path)
    run = Path(store.removeprefix("file://")) / "runs" / "base" / "RUN.json"
    record = json.loads(run.read_text())
    record["spec"]["model"] = {**MODEL, "d_model": 65536, "n_layers": 256, "n_heads": 64,
                               "n_kv_heads": 64}
    run.write_text(json.dumps(record))
    ours = dataset(tmp_path / "ours", "tokenizer A")
    with pytest.raises(BadConfig) as err:
        check_teacher(student(store), ours, load_manifest(ours))
    assert err.value.field == "distill.max_teacher_params"
    assert "4,000,000,000" in err.value.problem


@pytest.mark.parametrize("model", [{"d_model": "wide"}, {"n_layers": 10**30}, "a string"])
def test_a_stored_teacher_model_that_does_not_read_is_bad_config_naming_distill_teacher(
        tmp_path, model):
    store = source_store(tmp_path)
    run = Path(store.removeprefix("file://")) / "runs" / "base" / "RUN.json"
    record = json.loads(run.read_text())
    record["spec"]["model"] = {**MODEL, **model} if isinstance(model, dict) else model
    run.write_text(json.dumps(record))
    ours = dataset(tmp_path / "ours", "tokenizer A")
    with pytest.raises(BadConfig) as err:
        check_teacher(student(store), ours, load_manifest(ours))
    assert err.value.field == "distill.teacher" and "run base" in err.value.problem


def test_max_teacher_params_is_bounded_and_left_out_of_the_hash_at_its_default():
    for bad in (0, 10**12 + 1, "many", 1.5):
        with pytest.raises(BadConfig) as err:
            RunSpec.from_dict({"run_id": "s", "distill": {"max_teacher_params": bad}})
        assert err.value.field == "distill.max_teacher_params"
    assert RunSpec.from_dict({"run_id": "s"}).spec_hash() == RunSpec.from_dict(
        {"run_id": "s", "distill": {"max_teacher_params": 4_000_000_000}}).spec_hash()
