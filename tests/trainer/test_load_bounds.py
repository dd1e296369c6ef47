"""A checkpoint file cannot make its loader allocate what it never held, and any file that
fails to load is refused as a corrupt checkpoint's file (a fallback), never an error that is
retried into the same crash (trainer/load_bounds.py, trainer/safe_load.py)."""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.trainer.helpers import REPO, VOCAB, tiny_spec, write_spec
from trainer.evaluate import run_evaluate
from trainer.load_bounds import bytes_allowed
from trainer.model import GPT
from trainer.safe_load import UnsafeCheckpointFile, safe_torch_load

MODEL = "mp_rank_00_model_states.pt"


class Claims:
    """Pickles as torch's own tensor rebuild over a 4-element storage, with the shape and
    stride a bucket writer chooses: the weights-only unpickler allows exactly this call."""

    def __init__(self, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.size, self.stride = size, stride

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, (torch.zeros(4)._typed_storage(), 0, self.size,
                                                  self.stride, False, collections.OrderedDict()))


def claiming(path: Path, size: tuple[int, ...], stride: tuple[int, ...]) -> Path:
    torch.save({"module": {"w": Claims(size, stride)}}, path)
    return path


def deflated(path: Path, numel: int) -> Path:
    """A real torch file of `numel` zero floats, its members recompressed with DEFLATE."""
    plain = path.with_suffix(".plain")
    torch.save({"module": {"w": torch.zeros(numel)}}, plain)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for member in src.infolist():
            dst.writestr(member.filename, src.read(member.filename))
    plain.unlink()
    return path


def truncated(path: Path) -> Path:
    torch.save({"module": {"w": torch.zeros(1000)}}, path)
    path.write_bytes(path.read_bytes()[:3000])
    return path


BAD_FILES = {
    "shape_beyond_storage": lambda p: claiming(p, (8,), (1,)),  # torch: RuntimeError
    "stride_zero_giant_view": lambda p: claiming(p, (10**6, 10**6), (0, 0)),  # numel 10^12
    "deflated_bomb": lambda p: deflated(p, 4 * 2**20),  # 16 MiB inflated from ~17 KB
    "truncated": truncated,
    "not_a_torch_file": lambda p: (p.write_bytes(b"\x80\x02}q\x00." * 8), p)[1],
}


@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_file_that_cannot_be_loaded_safely_is_refused_never_raised_as_a_crash(kind, tmp_path):
    path = BAD_FILES[kind](tmp_path / MODEL)
    with pytest.raises(UnsafeCheckpointFile) as refused:
        safe_torch_load(str(path), map_location="cpu")
    assert refused.value.path == str(path) and refused.value.reason


def test_a_file_holding_more_than_the_model_shapes_allow_is_refused(tmp_path):
    path = tmp_path / MODEL
    torch.save({"module": {"w": torch.zeros(1000)}}, path)
    with pytest.raises(UnsafeCheckpointFile, match="more than a checkpoint file of this model"):
        safe_torch_load(str(path), max_bytes=2000)
    assert safe_torch_load(str(path), max_bytes=bytes_allowed(1000))["module"]["w"].numel() == 1000


def test_a_real_tensor_file_loads_with_the_bounds_on(tmp_path):
    path = tmp_path / MODEL
    sd = GPT(tiny_spec(tmp_path).model, VOCAB, seed=0).state_dict()
    torch.save({"module": sd}, path)
    loaded = safe_torch_load(str(path), max_bytes=bytes_allowed(sum(t.numel() for t in sd.values())))
    assert all(torch.equal(loaded["module"][k], v) for k, v in sd.items())


# Measured in a fresh process: its peak RSS would grow by the inflated size had torch
# inflated the member before the refusal.
_MEASURE = """
import json, sys
from trainer.safe_load import UnsafeCheckpointFile, allowed_globals, safe_torch_load
def peak_mib():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM")) // 1024
allowed_globals()  # DeepSpeed's import, before the baseline
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (the imports') is forgotten: it restarts from now
before = peak_mib()
try:
    safe_torch_load(sys.argv[1]); outcome = "loaded"
except UnsafeCheckpointFile as exc:
    outcome = exc.reason
print(json.dumps({"outcome": outcome, "grew_mib": peak_mib() - before}))
"""


@pytest.mark.process
def test_a_deflated_member_is_refused_before_anything_is_inflated(tmp_path):
    bomb = deflated(tmp_path / MODEL, 32 * 2**20)  # 128 MiB inflated
    assert bomb.stat().st_size < 2**20
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(bomb)], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=240,
                          env={"PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"})
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "inflate to" in result["outcome"], result
    assert result["grew_mib"] < 32, result


@pytest.mark.parametrize("kind", ["shape_beyond_storage", "stride_zero_giant_view",
                                  "deflated_bomb"])
def test_evaluate_falls_back_past_a_file_that_cannot_be_loaded_safely(kind, tmp_path,
                                                                     dataset_uri):
    spec = tiny_spec(tmp_path / "store")
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    for step in (0, 4):
        local = tmp_path / f"local{step}"
        local.mkdir()
        if step == 0:
            torch.save({"module": GPT(spec.model, VOCAB, seed=spec.seed).state_dict()},
                       local / MODEL)
        else:
            BAD_FILES[kind](local / MODEL)
        store.commit(step, str(local))
    args = argparse.Namespace(spec=write_spec(spec, tmp_path / "spec.json"), dataset=dataset_uri,
                              steps="4", workdir=str(tmp_path / "ev"), out="")
    out = run_evaluate(args)
    assert out["fallbacks"] == [{"requested": 4, "evaluated": 0}]
    corrupt = read_events(spec.storage.durable, spec.run_id, kinds=("checkpoint_corrupt",))
    assert [(e["step"], e["payload"]["file"]) for e in corrupt] == [(4, MODEL)]
