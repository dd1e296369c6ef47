"""Helpers for trainer tests: a tiny dataset, a tiny RunSpec, and running a segment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from spec import RunSpec
from storage.dataset import DatasetManifest, commit_manifest, token_dtype, write_shard
from storage.fs import resolve

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512


def make_dataset(root: Path, *, vocab: int = VOCAB, train_tokens: int = 40_000,
                 val_tokens: int = 4_000, seed: int = 0) -> str:
    """Write a small token dataset with learnable structure; return its manifest URI.

    Tokens follow a noisy "next = prev + 1 (mod vocab)" rule so a tiny model's loss falls.
    """
    rng = np.random.default_rng(seed)
    fs, directory = resolve(str(root / "dataset"))
    fs.makedirs(directory, exist_ok=True)
    shards = []
    for split, n in (("train", train_tokens), ("val", val_tokens)):
        steps = np.where(rng.random(n) < 0.8, 1, rng.integers(0, vocab, n))
        tokens = (np.cumsum(steps) % vocab).astype(token_dtype(vocab))
        doc_starts = np.arange(0, n, 500, dtype=np.uint64)
        shards.append(write_shard(fs, directory, f"{split}-00000", split, tokens, doc_starts))
    manifest = DatasetManifest(content_hash="test", vocab_size=vocab, eos_id=vocab - 1,
                               dtype=token_dtype(vocab), shards=tuple(shards))
    commit_manifest(fs, directory, manifest)
    return fs.unstrip_protocol(f"{directory}/MANIFEST.json")


TINY = {
    "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
    "model.seq_len": 32, "train.micro_batch_tokens": 128, "train.total_steps": 40,
    "train.segment_steps": 20, "train.warmup_steps": 2, "train.checkpoint_every": 4,
    "train.eval_batches": 4, "sweep.enabled": False,
}


def tiny_spec(store: Path, **overrides) -> RunSpec:
    return RunSpec(run_id="t").replace(**{**TINY, "storage.durable": str(store), **overrides})


def write_spec(spec: RunSpec, path: Path) -> str:
    path.write_text(json.dumps(spec.to_dict()))
    return str(path)


def run_segment(spec_path: str, dataset: str, to_step: int, workdir: Path, *, world: int = 1,
                attempt: int = 1, timeout: float = 300, extra: tuple[str, ...] = ()
                ) -> subprocess.CompletedProcess:
    """Run `trainer.segment` under torchrun exactly as the supervisor does."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(world), "-m", "trainer.segment", "--spec", spec_path,
           "--dataset", dataset, "--to-step", str(to_step), "--workdir", str(workdir),
           "--attempt", str(attempt), *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_rank_module(module: str, *args: str) -> dict:
    """Run `python -m module args` as one DeepSpeed rank on CPU (world size 1, its own
    rendezvous port); the JSON of its last `RESULT ` line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def resumed_at_another_layout_error(tmp_path: Path, written: dict, resumed: dict) -> str:
    """A 2-rank segment at the `written` overrides to step 4, then the same run resumed at
    the `resumed` ones (one rank) to step 8: that launch's error.json, as text (it must
    fail: a checkpoint resumes only at the layout it was written at)."""
    dataset = make_dataset(tmp_path / "data")
    proc = run_segment(write_spec(tiny_spec(tmp_path / "store", **written), tmp_path / "w.json"),
                       dataset, 4, tmp_path / "w1", world=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = run_segment(write_spec(tiny_spec(tmp_path / "store", **resumed), tmp_path / "r.json"),
                       dataset, 8, tmp_path / "w2", attempt=2)
    assert proc.returncode != 0
    return json.dumps(json.loads((tmp_path / "w2" / "error.json").read_text()))
