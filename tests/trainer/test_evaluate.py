"""`python -m trainer.evaluate` on checkpoints committed by a real segment."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from storage.dataset import read_split
from tests.trainer.helpers import REPO, VOCAB, run_segment, tiny_spec, write_spec
from trainer.data import val_batches
from trainer.evaluate import evaluate_model
from trainer.model import GPT

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset_uri) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("eval")
    spec = write_spec(tiny_spec(root / "store", **{"train.checkpoint_every": 10}),
                      root / "spec.json")
    proc = run_segment(spec, dataset_uri, 20, root / "w")
    assert proc.returncode == 0, proc.stderr[-5000:]
    return root, spec


def evaluate(spec: str, dataset: str, steps: str, root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "trainer.evaluate", "--spec", spec, "--dataset",
                           dataset, "--steps", steps, "--workdir", str(root / "ev"), "--out",
                           str(root / "out.json")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_evaluate_reports_val_loss_and_training_lowers_it(trained, dataset_uri):
    root, spec = trained
    proc = evaluate(spec, dataset_uri, "0,20", root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((root / "out.json").read_text())["results"]
    assert [r["step"] for r in results] == [0, 20]
    assert results[0]["val_loss"] == pytest.approx(math.log(VOCAB), abs=0.3)  # untrained
    assert results[1]["val_loss"] < results[0]["val_loss"] - 0.1
    assert all(r["perplexity"] == pytest.approx(math.exp(r["val_loss"])) for r in results)


def test_evaluate_of_step_zero_matches_a_freshly_seeded_model(trained, dataset_uri):
    root, spec_path = trained
    proc = evaluate(spec_path, dataset_uri, "0", root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = tiny_spec(root / "store", **{"train.checkpoint_every": 10})
    tokens, _ = read_split(dataset_uri, "val")
    batches = val_batches(tokens, seq_len=32, batch_size=4, k=spec.train.eval_batches)
    expected = evaluate_model(GPT(spec.model, VOCAB, seed=spec.seed), batches)
    got = json.loads((root / "out.json").read_text())["results"][0]["val_loss"]
    assert got == expected


def test_evaluate_model_weights_every_token_equally():
    model = GPT(tiny_spec(Path("/tmp")).model, VOCAB, seed=0)
    x = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    whole = evaluate_model(model, [(x, x)])
    split = evaluate_model(model, [(x[:1], x[:1]), (x[1:], x[1:])])
    assert split == pytest.approx(whole, rel=1e-6)


def test_uncommitted_step_is_bad_data_exit_3(trained, dataset_uri):
    root, spec = trained
    proc = evaluate(spec, dataset_uri, "0,15", root)
    assert proc.returncode == 3
    error = json.loads((root / "ev" / "error.json").read_text())
    assert error["type"] == "BadData" and "[15]" in error["message"]


def test_zero3_checkpoint_weights_are_reassembled_for_evaluation(tmp_path, dataset_uri):
    # ZeRO-3 model-state files hold empty partitions; evaluate must rebuild the full weights:
    # step 0 then scores exactly like a freshly seeded model, and step 4 scores differently.
    over = {"train.zero_stage": 3, "train.checkpoint_every": 4}
    spec_path = write_spec(tiny_spec(tmp_path / "store", **over), tmp_path / "spec.json")
    proc = run_segment(spec_path, dataset_uri, 4, tmp_path / "w")
    assert proc.returncode == 0, proc.stderr[-5000:]
    step0 = tmp_path / "store" / "runs" / "t" / "checkpoints" / "step-000000000"
    assert not (step0 / "mp_rank_00_model_states.pt").exists()
    proc = evaluate(spec_path, dataset_uri, "0,4", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    spec = tiny_spec(tmp_path / "store", **over)
    tokens, _ = read_split(dataset_uri, "val")
    batches = val_batches(tokens, seq_len=32, batch_size=4, k=spec.train.eval_batches)
    assert results[0]["val_loss"] == evaluate_model(GPT(spec.model, VOCAB, seed=spec.seed), batches)
    assert results[1]["val_loss"] != results[0]["val_loss"]
