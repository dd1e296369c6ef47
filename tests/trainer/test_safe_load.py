"""No checkpoint file runs code when loaded (a crafted pickle once ran a shell command): real
DeepSpeed checkpoints (ZeRO 0 and 2, world size 1) load bitwise through the weights-only loader that every engine
gets, and a pickle that calls `os.system` — in the model file, in a ZeRO optimizer shard, in
a TrainState file, or in what `trainer.evaluate` reads — is refused before it runs.

DeepSpeed work runs in a child process (`python -m tests.trainer.test_safe_load …`, the
`__main__` block below) so no test initialises torch.distributed inside pytest."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from storage.checkpoints import CheckpointStore, step_dir
from storage.events import read_events
from tests.trainer.helpers import VOCAB, run_rank_module, tiny_spec, write_spec
from trainer.evaluate import run_evaluate
from trainer.model import GPT
from trainer.safe_load import UnsafeCheckpointFile, safe_torch_load
from trainer.state import TrainState, state_file

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

TAG = step_dir(2)
MODEL, OPTIM = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class RunsShell:
    """Pickles as a call of os.system: what a bucket writer would plant."""

    def __init__(self, marker: Path) -> None:
        self.command = f"touch {marker}"

    def __reduce__(self):
        return (os.system, (self.command,))


def plant(path: Path, marker: Path, key: str) -> None:
    torch.save({key: RunsShell(marker), "pad": torch.zeros(4)}, path)


def child(*args: str) -> dict:
    """Run this module's __main__ as one DeepSpeed rank on CPU; its RESULT line."""
    return run_rank_module("tests.trainer.test_safe_load", *args)


@pytest.fixture(scope="module", params=[0, 2], ids=["zero0", "zero2"])
def saved(request, tmp_path_factory) -> tuple[int, Path, dict]:
    """A real checkpoint of a trained engine, and how a fresh engine loaded it back."""
    root = tmp_path_factory.mktemp(f"zero{request.param}")
    return request.param, root, child("roundtrip", str(root), str(request.param))


def test_real_deepspeed_checkpoint_loads_bitwise_through_the_weights_only_loader(saved):
    zero, root, result = saved
    assert result["engine"] == "SafeTorchCheckpointEngine"  # build_engine installed it
    assert result["weights_equal"] and result["next_step_equal"], result
    written = sorted(os.listdir(root / "ckpt" / TAG))
    assert written == ([MODEL] if zero == 0 else [MODEL, OPTIM])
    assert result["files_read"] == written  # every file went through safe_torch_load


# ZeRO 0 keeps the optimizer state inside the model file; ZeRO 2 has its own shard.
@pytest.mark.parametrize(("saved", "victim"), [(0, MODEL), (2, MODEL), (2, OPTIM)],
                         ids=["zero0-model", "zero2-model", "zero2-optim"], indirect=["saved"])
def test_pickle_payload_in_a_deepspeed_file_is_refused_by_load_checkpoint(saved, victim,
                                                                         tmp_path):
    zero, root, _ = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    plant(tmp_path / "ckpt" / TAG / victim, marker, "module" if victim == MODEL else
          "optimizer_state_dict")
    result = child("load", str(tmp_path), str(zero))
    assert result["error"] == "UnsafeCheckpointFile", result
    assert result["path"].endswith(victim) and "system" in result["reason"]
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["shape_beyond_storage", "stride_zero_giant_view",
                                  "deflated_bomb"])
@pytest.mark.parametrize("saved", [2], ids=["zero2"], indirect=True)
def test_an_optimizer_shard_out_of_bounds_is_refused_by_load_checkpoint_not_crashed_on(
        saved, kind, tmp_path):
    from tests.trainer.test_load_bounds import BAD_FILES

    _, root, _ = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    (tmp_path / "ckpt" / TAG / OPTIM).unlink()
    BAD_FILES[kind](tmp_path / "ckpt" / TAG / OPTIM)
    result = child("load", str(tmp_path), "2")
    assert result["error"] == "UnsafeCheckpointFile" and result["path"].endswith(OPTIM), result


def test_pickle_payload_in_a_train_state_file_is_refused(tmp_path):
    state = TrainState(step=3)
    path = tmp_path / state_file(0)
    state.save(str(path))
    assert safe_torch_load(str(path))["step"] == 3  # a real one loads
    marker = tmp_path / "pwned"
    plant(path, marker, "rng")
    with pytest.raises(UnsafeCheckpointFile) as refused:
        safe_torch_load(str(path))
    assert refused.value.path == str(path) and "system" in refused.value.reason
    with pytest.raises(UnsafeCheckpointFile):  # the resume path reads it the same way
        TrainState.load(str(path))
    assert not marker.exists()


def test_evaluate_refuses_a_planted_model_file_and_falls_back_to_the_step_before(
        tmp_path, dataset_uri):
    spec = tiny_spec(tmp_path / "store")
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    fresh = GPT(spec.model, VOCAB, seed=spec.seed)
    marker = tmp_path / "pwned"
    for step in (0, 4):
        local = tmp_path / f"local{step}"
        local.mkdir()
        if step == 0:
            torch.save({"module": fresh.state_dict()}, local / MODEL)
        else:
            plant(local / MODEL, marker, "module")
        store.commit(step, str(local))
    args = argparse.Namespace(spec=write_spec(spec, tmp_path / "spec.json"), dataset=dataset_uri,
                              steps="0,4", workdir=str(tmp_path / "ev"), out="")
    out = run_evaluate(args)
    assert not marker.exists()
    assert [r["step"] for r in out["results"]] == [0]
    assert out["fallbacks"] == [{"requested": 4, "evaluated": 0}]
    corrupt = read_events(spec.storage.durable, spec.run_id, kinds=("checkpoint_corrupt",))
    assert [(e["step"], e["payload"]["file"]) for e in corrupt] == [(4, MODEL)]


# A manifest's extra.world_size that differs from this world (whoever writes the bucket writes
# it) sends the load through DeepSpeed's ds_to_universal conversion, a child process.
@pytest.mark.parametrize("victim", [MODEL, OPTIM, state_file(0)])
@pytest.mark.parametrize("saved", [2], ids=["zero2"], indirect=True)
def test_a_crafted_file_never_runs_through_the_resharding_path(saved, victim, tmp_path):
    _, root, _ = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    result = child("reshard", str(tmp_path), "2", victim, str(marker))
    assert not marker.exists()
    assert result["error"] == "CorruptCheckpoint" and result["file"] == victim, result
    assert "system" in result["actual"]


@pytest.mark.parametrize("saved", [2], ids=["zero2"], indirect=True)
def test_a_deflated_optimizer_shard_is_a_corrupt_checkpoint_on_the_resharding_path(saved,
                                                                                   tmp_path):
    from tests.trainer.test_load_bounds import BAD_FILES

    _, root, _ = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    (tmp_path / "ckpt" / TAG / OPTIM).unlink()
    BAD_FILES["deflated_bomb"](tmp_path / "ckpt" / TAG / OPTIM)
    result = child("reshard", str(tmp_path), "2")
    assert result["error"] == "CorruptCheckpoint" and result["file"] == OPTIM, result
    assert "inflate to" in result["actual"]


@pytest.mark.parametrize("saved", [2], ids=["zero2"], indirect=True)
def test_the_conversion_child_itself_refuses_a_payload_the_rank_did_not_check(saved, tmp_path):
    """The converter's own process loads weights-only (environment and allow-list), not
    only the rank that checks each file before starting it."""
    from trainer.elastic import conversion_command, conversion_env
    from trainer.universal import EXIT_REFUSED, REFUSED

    _, root, _ = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    plant(tmp_path / "ckpt" / TAG / OPTIM, marker, "optimizer_state_dict")
    done = subprocess.run(conversion_command(str(tmp_path / "ckpt" / TAG), str(tmp_path / "u")),
                          env=conversion_env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, check=False)
    assert not marker.exists()
    assert done.returncode == EXIT_REFUSED, done.stdout[-2000:] + done.stderr[-2000:]
    assert any(ln.startswith(REFUSED) and "system" in ln for ln in done.stdout.splitlines())


@pytest.mark.parametrize("saved", [2], ids=["zero2"], indirect=True)
def test_a_real_checkpoint_still_reshards_with_weights_only_loading_forced(saved, tmp_path):
    _, root, _ = saved
    shutil.copytree(root / "ckpt", tmp_path / "ckpt")
    result = child("reshard", str(tmp_path), "2")
    assert result == {"error": None, "weights_equal": True, "step": 2}, result


@pytest.mark.parametrize("world_size", ["two", 2.5, None, [2], True, 0])
def test_a_malformed_saved_world_size_is_a_corrupt_checkpoint(world_size):
    from storage.checkpoints import CorruptCheckpoint
    from trainer.elastic import saved_layout

    with pytest.raises(CorruptCheckpoint) as bad:
        saved_layout({"world_size": world_size, "zero_stage": 2}, step=6, world=1)
    assert bad.value.step == 6 and bad.value.file == "MANIFEST.json"
    assert saved_layout({"world_size": 2, "zero_stage": 2}, step=6, world=1) == (2, 2)
    assert saved_layout({}, step=6, world=1) == (1, 0)  # an older manifest: this world


# ---- the child process ------------------------------------------------------------------------
def _engine(seed: int, zero: int):
    from trainer.engine import build_engine

    spec = tiny_spec(Path("/tmp"), **{"train.zero_stage": zero})
    return build_engine(spec, GPT(spec.model, VOCAB, seed=seed))


def _train(engine, steps: int) -> None:
    g = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, 32), generator=g)
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _main(argv: list[str]) -> dict:
    import deepspeed

    from trainer import safe_load

    deepspeed.init_distributed(dist_backend="gloo")
    cmd, root, zero = argv[0], Path(argv[1]), int(argv[2])
    read: list[str] = []
    real = safe_load.safe_torch_load

    def counting(path, **kw):
        read.append(os.path.basename(path))
        return real(path, **kw)

    safe_load.safe_torch_load = counting  # the engine's loader calls it through the module
    if cmd == "roundtrip":
        a = _engine(0, zero)
        _train(a, 2)
        a.save_checkpoint(str(root / "ckpt"), tag=TAG, save_latest=False)
        b = _engine(1, zero)
        assert not _same(_params(a), _params(b))
        b.load_checkpoint(str(root / "ckpt"), tag=TAG)
        weights = _same(_params(a), _params(b))
        _train(a, 1)
        _train(b, 1)
        return {"engine": type(b.checkpoint_engine).__name__, "weights_equal": weights,
                "next_step_equal": _same(_params(a), _params(b)), "files_read": sorted(set(read))}
    if cmd == "reshard":
        return _reshard(root, zero, *argv[3:])
    try:
        _engine(1, zero).load_checkpoint(str(root / "ckpt"), tag=TAG)
    except UnsafeCheckpointFile as exc:
        return {"error": type(exc).__name__, "path": exc.path, "reason": exc.reason}
    return {"error": None}


def _reshard(root: Path, zero: int, victim: str = "", marker: str = "") -> dict:
    """Load `root/ckpt` through the resume path (trainer/checkpointing.py `load_checkpoint`)
    with a manifest that says it was written at world size 2: the resharding path. With
    `victim`, that file (the train state this writes too) is first replaced by a payload."""
    from types import SimpleNamespace

    from storage.checkpoints import CorruptCheckpoint
    from trainer.checkpointing import load_checkpoint

    TrainState(step=2).save(str(root / "ckpt" / TAG / state_file(0)))
    if victim:
        plant(root / "ckpt" / TAG / victim, Path(marker), "rng" if victim == state_file(0)
              else "module" if victim == MODEL else "optimizer_state_dict")
    ctx = SimpleNamespace(workdir=str(root / "work"), rank=0, world=1, config_hash="h",
                          fast_store=SimpleNamespace(root=str(root / "ckpt")))
    man = SimpleNamespace(config_hash="h", extra={"world_size": 2, "zero_stage": zero})
    saved = _engine(0, zero)
    _train(saved, 2)  # the same seed and steps as the roundtrip's saved engine
    engine = _engine(1, zero)
    try:
        state = load_checkpoint(ctx, engine, 2, "fast", man)
    except CorruptCheckpoint as exc:
        return {"error": type(exc).__name__, "file": exc.file, "actual": exc.actual}
    return {"error": None, "weights_equal": _same(_params(saved), _params(engine)),
            "step": state.step}


if __name__ == "__main__":
    print("RESULT " + json.dumps(_main(sys.argv[1:])), flush=True)
