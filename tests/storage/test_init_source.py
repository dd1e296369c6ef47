"""`train.init_from` checked before any accelerator is used: the source run's promoted
checkpoint exists, and this run's model shape and tokenizer are the source's — else a
BadConfig naming both and the fix (storage/init_source.py)."""

from __future__ import annotations

import pytest

from common.errors import BadConfig
from spec import RunSpec
from storage.dataset import load_manifest
from storage.init_source import check_fit, promoted_source
from tests.storage.source_runs import MODEL, SOURCE_HASH, dataset, source_store


@pytest.fixture
def store(tmp_path) -> str:
    """Run `base` (MODEL, tokenizer A) with steps 4 and 8 promoted."""
    return source_store(tmp_path)


def child(url: str, init_from: str = "base", **model) -> RunSpec:
    return RunSpec.from_dict({"run_id": "child", "model": {**MODEL, **model},
                              "train": {"micro_batch_tokens": 128, "init_from": init_from},
                              "storage": {"durable": url}})


def test_the_newest_promoted_step_or_the_one_named_is_the_source(store):
    assert promoted_source(store, "base").step == 8
    assert promoted_source(store, "base@4").step == 4
    with pytest.raises(BadConfig) as err:
        promoted_source(store, "base@6")
    assert err.value.field == "train.init_from" and "[4, 8]" in err.value.fix
    with pytest.raises(BadConfig) as err:
        promoted_source(store, "nobody")
    assert "run nobody has no promoted checkpoint" in err.value.problem


def test_the_same_shape_and_tokenizer_fit(store, tmp_path):
    same = dataset(tmp_path / "data-b", "tokenizer A")  # another corpus, the same tokenizer
    source = check_fit(child(store), same, load_manifest(same))
    assert source.lineage()["source_run"] == "base" and source.lineage()["source_step"] == 8
    assert source.uri.endswith("runs/base/promoted/step-000000008")


def test_another_model_shape_is_refused_naming_both(store, tmp_path):
    same = dataset(tmp_path / "data-b", "tokenizer A")
    with pytest.raises(BadConfig) as err:
        check_fit(child(store, d_model=64), same, load_manifest(same))
    assert err.value.field == "train.init_from"
    assert "d_model 32 there, 64 here" in err.value.problem and "model.*" in err.value.fix


def test_another_tokenizer_is_refused_with_the_sources_tokenizer_to_use(store, tmp_path):
    other = dataset(tmp_path / "data-c", "tokenizer B")  # same size, other vocabulary
    with pytest.raises(BadConfig) as err:
        check_fit(child(store), other, load_manifest(other))
    assert "another tokenizer" in err.value.problem
    assert err.value.fix.startswith("set data.tokenizer.path to ")
    assert err.value.fix.endswith(f"datasets/{SOURCE_HASH}/tokenizer.json, the source's "
                                  "tokenizer")


def test_init_from_is_checked_for_its_form_and_never_names_the_run_itself():
    for bad in ("Base", "base@", "base@-1", "base@4@5"):
        with pytest.raises(BadConfig) as err:
            child("file:///tmp/s", bad)
        assert err.value.field == "train.init_from", bad
    with pytest.raises(BadConfig) as err:
        child("file:///tmp/s", "child@4")
    assert "names this run itself" in err.value.problem
    with pytest.raises(BadConfig) as err:
        RunSpec.from_dict({"run_id": "c", "train": {"init_from": "base", "zero_stage": 3}})
    assert err.value.field == "train.init_from"
    assert RunSpec.from_dict({"run_id": "c"}).spec_hash() == \
        RunSpec.from_dict({"run_id": "c", "train": {"init_from": ""}}).spec_hash()
