"""Safetensors export: a checkpoint's weights plus a config that names the architecture."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from common.errors import BadData
from spec import ModelConfig
from tests.trainer.helpers import REPO, VOCAB, run_segment, tiny_spec, write_spec
from trainer.export import ARCHITECTURE, load_exported, save_exported
from trainer.model import GPT


def cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=16),
                          **kw})


@pytest.mark.parametrize("tied", [True, False])
def test_exported_model_reloads_with_identical_logits(tmp_path, tied):
    model = GPT(cfg(tie_embeddings=tied), 97, seed=3).eval()
    save_exported(model.state_dict(), model.cfg, 97, str(tmp_path))
    again = load_exported(str(tmp_path)).eval()
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x)[0], again(x)[0])
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in stored) is not tied  # a tied head is stored once
    if tied:
        assert again.lm_head.weight is again.embed.weight


def test_export_config_names_the_architecture_and_shapes(tmp_path):
    save_exported(GPT(cfg(), 97).state_dict(), cfg(), 97, str(tmp_path))
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["architectures"] == [ARCHITECTURE]
    assert (conf["vocab_size"], conf["n_kv_heads"], conf["ffn_hidden"]) == (97, 2, 128)


def test_export_with_the_wrong_architecture_is_bad_data(tmp_path):
    save_exported(GPT(cfg(), 97).state_dict(), cfg(), 97, str(tmp_path))
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**conf, "architectures": ["Other"]}))
    with pytest.raises(BadData):
        load_exported(str(tmp_path))


@pytest.mark.e2e
def test_export_cli_writes_the_committed_weights(tmp_path, dataset_uri):
    spec = tiny_spec(tmp_path / "store", **{"train.checkpoint_every": 4})
    spec_path = write_spec(spec, tmp_path / "spec.json")
    assert run_segment(spec_path, dataset_uri, 4, tmp_path / "w").returncode == 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "trainer.export", "--spec", spec_path,
                           "--dataset", dataset_uri, "--step", "4", "--workdir",
                           str(tmp_path / "ex"), "--out", str(tmp_path / "out")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(tmp_path / "store/runs/t/checkpoints/step-000000004/mp_rank_00_model_states.pt",
                      map_location="cpu", weights_only=False)["module"]
    model = load_exported(str(tmp_path / "out"))
    assert torch.equal(model.state_dict()["embed.weight"], ckpt["embed.weight"])
    assert not torch.equal(ckpt["embed.weight"], GPT(spec.model, VOCAB, seed=spec.seed).embed.weight)
