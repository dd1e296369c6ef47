"""A bad TP shard or PP layer file is a corrupt checkpoint like any other (trainer/merge.py):
shards or layers that do not fit together, or do not make the model's weights, are a
CorruptCheckpoint naming the step and the file — so evaluation falls back to the older good
step, export refuses with BadData, and the resharding converter refuses (exit 3) instead
of crashing into retries. The checkpoints are written as DeepSpeed lays them out
(tests/trainer/layouts.py); no engine is needed to read them."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
import torch

from common.errors import BadData
from storage.checkpoints import CorruptCheckpoint
from tests.trainer.helpers import VOCAB, tiny_spec, write_spec
from tests.trainer.layouts import commit_files, pp_files, pp_layers, tp_files, tp_shards
from trainer.elastic import conversion_command, conversion_env
from trainer.evaluate import load_usable
from trainer.export import run_export
from trainer.merge import WeightsMisfit
from trainer.model import GPT
from trainer.universal import EXIT_REFUSED, REFUSED

WQ, W2 = "blocks.0.attn.wq.weight", "blocks.1.ffn.w2.weight"
BOTH = "mp_rank_00_model_states.pt .. mp_rank_01_model_states.pt"


def _drop(files: dict, name: str) -> dict:
    return {k: v for k, v in files.items() if k != name}


def _rename(files: dict, old: str, new: str) -> dict:
    return {(new if k == old else k): v for k, v in files.items()}


def _set(shards: list[dict], ranks: tuple[int, ...], name: str, value) -> None:
    for r in ranks:
        shards[r][name] = value(shards[r][name]) if callable(value) else value


def _del(shards: list[dict], rank: int, name: str) -> None:
    del shards[rank][name]


# (edit of the shards, edit of the files, the file named, a misfit: whole but misshapen)
TP_DAMAGE = {
    "a name missing from one shard": (lambda s: _del(s, 1, WQ), None,
                                      "mp_rank_01_model_states.pt", False),
    "a name only one shard holds": (lambda s: _set(s, (1,), "blocks.0.attn.bogus",
                                                   torch.ones(2)), None,
                                    "mp_rank_01_model_states.pt", False),
    "pieces of unequal shape": (lambda s: _set(s, (1,), WQ, lambda t: t[:1]), None,
                                "mp_rank_01_model_states.pt", False),
    "pieces of another dtype": (lambda s: _set(s, (1,), W2, lambda t: t.double()), None,
                                "mp_rank_01_model_states.pt", False),
    "a value that is not a tensor": (lambda s: _set(s, (1,), "norm.weight", 3), None,
                                     "mp_rank_01_model_states.pt", False),
    "pieces that merge to another shape": (lambda s: _set(s, (0, 1), WQ, lambda t: t[:4]),
                                           None, BOTH, True),
    "integers where floats belong": (lambda s: _set(s, (0, 1), "embed.weight",
                                                    lambda t: t.long()), None, BOTH, False),
    "a shard fewer than the manifest's tp": (
        None, lambda f: _drop(f, "mp_rank_01_model_states.pt"),
        "mp_rank_01_model_states.pt", False),
    "a gap in the shards' ranks": (
        None, lambda f: _rename(f, "mp_rank_01_model_states.pt", "mp_rank_02_model_states.pt"),
        "mp_rank_01_model_states.pt", False),
}


def _fallback(tmp_path: Path, good: dict, bad: dict, model: GPT, **extra: int):
    """Steps 4 (`good`) and 8 (`bad`) committed; evaluation's reader asked for step 8."""
    store = tmp_path / "store"
    commit_files(store, "t", 4, good, tmp_path, **extra)
    ckpts = commit_files(store, "t", 8, bad, tmp_path, **extra)
    seen: list[CorruptCheckpoint] = []
    used = load_usable(ckpts, model, 8, [4, 8], str(tmp_path / "w"), seen.append)
    return used, seen


@pytest.mark.parametrize("damage", TP_DAMAGE, ids=list(TP_DAMAGE))
def test_a_bad_tp_shard_is_a_corrupt_checkpoint_and_evaluation_falls_back(tmp_path, damage):
    edit_shards, edit_files, file, misfit = TP_DAMAGE[damage]
    spec = tiny_spec(tmp_path / "store")
    old, new = GPT(spec.model, VOCAB, seed=1), GPT(spec.model, VOCAB, seed=2)
    bad = tp_files(tp_shards(new.state_dict(), 2), edit_shards or (lambda s: None))
    bad = edit_files(bad) if edit_files else bad
    model = GPT(spec.model, VOCAB, seed=3)
    used, seen = _fallback(tmp_path, tp_files(tp_shards(old.state_dict(), 2)), bad, model, tp=2)
    assert used == 4
    assert [(e.step, e.file) for e in seen] == [(8, file)]
    assert isinstance(seen[0], WeightsMisfit) == misfit
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in model.state_dict().items())


def _layer(index: int, name: str, value):
    def edit(layers: list[dict]) -> None:
        if name is None:
            layers[index] = None
        else:
            layers[index][name] = value
    return edit


# (tied embeddings, edit of the layers, the file named): the tiny GPT has 2 blocks, so
# layers 0 (embedding), 1-2 (blocks), 3 (norm) and, untied, 4 (head)
PP_DAMAGE = {
    "a layer's file missing": (True, _layer(1, None, None), "layer_01-model_states.pt"),
    "two layers naming one weight": (True, _layer(2, "embed.weight", torch.ones(VOCAB, 32)),
                                     "layer_02-model_states.pt"),
    "a weight no layer of the model holds": (True, _layer(1, "block.attn.bogus", torch.ones(2)),
                                             "layer_01-model_states.pt"),
    "a value that is not a tensor": (True, _layer(3, "norm.weight", "x"),
                                     "layer_03-model_states.pt"),
    "an untied head's file missing": (False, _layer(4, None, None), "layer_"),
}


@pytest.mark.parametrize("damage", PP_DAMAGE, ids=list(PP_DAMAGE))
def test_a_bad_pp_layer_file_is_a_corrupt_checkpoint_and_evaluation_falls_back(tmp_path,
                                                                              damage):
    tied, edit, file = PP_DAMAGE[damage]
    spec = tiny_spec(tmp_path / "store", **{"model.tie_embeddings": tied})
    old, new = GPT(spec.model, VOCAB, seed=1), GPT(spec.model, VOCAB, seed=2)
    n = spec.model.n_layers
    bad = pp_files(pp_layers(new.state_dict(), n, tied), edit)
    model = GPT(spec.model, VOCAB, seed=3)
    used, seen = _fallback(tmp_path, pp_files(pp_layers(old.state_dict(), n, tied)), bad,
                           model, pp=2)
    assert used == 4
    assert [e.step for e in seen] == [8] and seen[0].file.startswith(file)
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in model.state_dict().items())


def test_good_tp_and_pp_checkpoints_load_whole_with_no_fallback(tmp_path):
    spec = tiny_spec(tmp_path / "store")
    src = GPT(spec.model, VOCAB, seed=1)
    for layout, files in (("tp", tp_files(tp_shards(src.state_dict(), 2))),
                          ("pp", pp_files(pp_layers(src.state_dict(), 2, True)))):
        model = GPT(spec.model, VOCAB, seed=3)
        used, seen = _fallback(tmp_path / layout, files, files, model, **{layout: 2})
        assert (used, seen) == (8, [])
        assert all(torch.equal(v, src.state_dict()[k]) for k, v in model.state_dict().items())


def _export(tmp_path: Path, dataset_uri: str, step: int) -> None:
    spec = write_spec(tiny_spec(tmp_path / "store"), tmp_path / "spec.json")
    run_export(argparse.Namespace(spec=spec, dataset=dataset_uri, step=step,
                                  workdir=str(tmp_path / "w"), out=str(tmp_path / "out")))


def test_export_of_a_bad_tp_shard_is_bad_data_naming_the_step_and_a_good_one_exports(
        tmp_path, dataset_uri):
    spec = tiny_spec(tmp_path / "store")
    shards = tp_shards(GPT(spec.model, VOCAB, seed=1).state_dict(), 2)
    commit_files(tmp_path / "store", "t", 4, tp_files(shards), tmp_path, tp=2)
    commit_files(tmp_path / "store", "t", 8, tp_files(shards, lambda s: _del(s, 1, WQ)),
                 tmp_path, tp=2)
    _export(tmp_path, dataset_uri, 4)
    assert (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(BadData) as err:
        _export(tmp_path, dataset_uri, 8)
    assert "checkpoint step 8" in err.value.problem
    assert "mp_rank_01_model_states.pt" in err.value.problem


@pytest.mark.process
def test_files_the_resharding_converter_cannot_convert_are_refused_exit_3_not_a_crash(
        tmp_path):
    """Files that load weights-only but are not a checkpoint the converter reads: the same
    on every retry, so a refusal (trainer/elastic.py: a corrupt checkpoint), not exit 1 (a
    crash the supervisor retries)."""
    src = tmp_path / "global_step4"
    src.mkdir()
    torch.save({"module": {"w": torch.ones(2)}}, src / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, src / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    done = subprocess.run(conversion_command(str(src), str(tmp_path / "out")),
                          env=conversion_env(), capture_output=True, text=True, timeout=120)
    refused = [ln for ln in done.stdout.splitlines() if ln.startswith(REFUSED)]
    assert done.returncode == EXIT_REFUSED, done.stderr[-2000:]
    assert "does not convert" in json.loads(refused[-1][len(REFUSED):])["reason"]
