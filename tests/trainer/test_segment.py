"""`python -m trainer.segment` as the supervisor runs it: real torchrun, real DeepSpeed (CPU)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.errors import BadData
from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.trainer.helpers import REPO, run_segment, tiny_spec, write_spec
from trainer.state import flat_tensors

pytestmark = pytest.mark.e2e

CKPT = "runs/t/checkpoints/step-{:09d}"


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    # DeepSpeed's ZeRO files pickle a LossScaler object; these are files this test just wrote.
    return flat_tensors(torch.load(path, map_location="cpu", weights_only=False))


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_pair(root: Path, dataset: str, world: int, zero: int, accum: int = 1
               ) -> tuple[Path, Path]:
    """Store A: 0 -> 8 in one process. Store B: 0 -> 4, then a new process 4 -> 8."""
    over = {"train.procs_per_node": world, "train.zero_stage": zero, "train.grad_accum": accum}
    a, b = root / "a", root / "b"
    spec_a = write_spec(tiny_spec(a, **over), root / "a.json")
    spec_b = write_spec(tiny_spec(b, **over), root / "b.json")
    ok(run_segment(spec_a, dataset, 8, root / "wa", world=world))
    ok(run_segment(spec_b, dataset, 4, root / "wb1", world=world))
    ok(run_segment(spec_b, dataset, 8, root / "wb2", world=world, attempt=2))
    return a, b


@pytest.fixture(scope="module")
def single(tmp_path_factory, dataset_uri) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("w1")
    a, b = train_pair(root, dataset_uri, world=1, zero=0)
    return root, a, b


def assert_bitwise_equal_step8(a: Path, b: Path) -> None:
    names = sorted(p.name for p in (a / CKPT.format(8)).glob("*.pt"))
    assert names == sorted(p.name for p in (b / CKPT.format(8)).glob("*.pt"))
    assert "mp_rank_00_model_states.pt" in names
    for name in names:
        ta, tb = load_tensors(a / CKPT.format(8) / name), load_tensors(b / CKPT.format(8) / name)
        assert ta.keys() == tb.keys() and ta, name
        different = [k for k in ta if not torch.equal(ta[k], tb[k])]
        assert different == [], (name, different)
    # The comparison is meaningful: training between steps 4 and 8 changed the weights.
    w4 = load_tensors(a / CKPT.format(4) / "mp_rank_00_model_states.pt")
    w8 = load_tensors(a / CKPT.format(8) / "mp_rank_00_model_states.pt")
    assert not torch.equal(w4["/module/embed.weight"], w8["/module/embed.weight"])


def test_resumed_segment_is_bitwise_equal_to_uninterrupted_run(single):
    root, a, b = single
    assert_bitwise_equal_step8(a, b)
    optim = load_tensors(b / CKPT.format(8) / "mp_rank_00_model_states.pt")
    assert any(k.startswith("/optimizer/state/") and "exp_avg" in k for k in optim)
    resumed = json.loads((root / "wb2" / "result.json").read_text())
    assert resumed["resumed_from"] == 4 and resumed["steps_run"] == 4
    last = [[p for p in read_jsonl(root / w / "progress.jsonl") if p["type"] == "step"][-1]
            for w in ("wa", "wb2")]
    assert last[0]["step"] == last[1]["step"] == 8
    assert last[0]["loss"] == last[1]["loss"]  # same last-step loss, bit for bit


def test_zero2_world_two_with_grad_accumulation_resumes_bitwise_equal(tmp_path, dataset_uri):
    a, b = train_pair(tmp_path, dataset_uri, world=2, zero=2, accum=2)
    assert_bitwise_equal_step8(a, b)
    assert CheckpointStore(str(b), "t").manifest(8).data_cursor == 16  # 2 micro-batches a step
    optim = sorted(p.name for p in (b / CKPT.format(8)).glob("zero_pp_rank_*_optim_states.pt"))
    assert optim == ["zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert {p.name for p in (b / CKPT.format(8)).glob("train_state-*")} == {
        "train_state-rank0.pt", "train_state-rank1.pt"}


def test_fresh_segment_commits_step_zero_then_every_checkpoint_interval(single):
    root, a, _ = single
    store = CheckpointStore(str(a), "t")
    assert store.list_committed() == [0, 4, 8]
    assert [store.manifest(s).parent for s in (0, 4, 8)] == [None, 0, 4]
    m8 = store.manifest(8)
    assert (m8.tokens_seen, m8.data_cursor) == (8 * 128, 8)
    assert m8.config_hash == tiny_spec(a).spec_hash()
    events = read_events(str(a), "t", kinds=("checkpoint_committed",))
    assert [(e["step"], e["event_id"]) for e in events] == [
        (s, f"checkpoint_committed/{s}") for s in (0, 4, 8)]
    assert events[-1]["payload"]["uri"] == store.uri(8)
    assert events[-1]["payload"]["bytes"] == m8.total_bytes
    # Only the newest local copy is kept on the fast tier.
    assert os.listdir(root / "wa" / "ckpt") == ["step-000000008"]


def test_progress_file_has_start_step_and_commit_lines_in_order(single):
    root, a, _ = single
    lines = read_jsonl(root / "wa" / "progress.jsonl")
    assert lines[0]["type"] == "start"
    assert lines[0]["resumed_from"] is None and lines[0]["world_size"] == 1
    assert lines[0]["params"] > 0
    kinds = [(ln["type"], ln["step"]) for ln in lines[1:]]
    assert [s for t, s in kinds if t == "step"] == list(range(1, 9))
    # Commits are durable uploads in the background: each line comes after its step was
    # trained (never before), in step order, and the last one before the segment ends.
    assert [s for t, s in kinds if t == "commit"] == [0, 4, 8] and kinds[-1] == ("commit", 8)
    assert all(kinds.index(("commit", c)) > kinds.index(("step", c)) for c in (4, 8))
    by_step = {ln["step"]: ln for ln in lines[1:] if ln["type"] == "step"}
    step = by_step[1]
    assert set(step) == {"type", "step", "loss", "lr", "verdict", "tokens_per_s", "step_time_s",
                         "mfu", "peak_mem_bytes", "grad_norm", "ts"}  # sampled fields: absent
    assert step["lr"] == pytest.approx(1.5e-3)  # warmup: lr * 1/2
    assert step["mfu"] == pytest.approx(step["tokens_per_s"] * lines[0]["flops_per_token"]
                                        / (lines[0]["peak_tflops"] * 1e12))
    assert lines[0]["packing"] is True
    assert lines[0]["peak_source"] == "measured:matmul_probe:float32"
    result = json.loads((root / "wa" / "result.json").read_text())
    throughput = result.pop("throughput")
    assert set(throughput) == {"tokens_per_s", "step_time_s", "mfu", "flops_per_token",
                               "peak_tflops", "peak_source", "peak_mem_bytes"}
    spikes = result.pop("outcome")
    assert spikes["rollbacks"] == [] and spikes["stopped"] == ""
    # the loop's pause for its 3 checkpoints (0, 4, 8): what "auto" intervals come from
    assert result.pop("checkpoints") == 3
    saved = read_events(str(a), "t", kinds=("checkpoint_saved",))
    assert result.pop("checkpoint_stall_s") == pytest.approx(
        sum(e["payload"]["pause_s"] for e in saved), abs=1e-3)
    losses = [by_step[s]["loss"] for s in range(1, 9)]
    assert result == {"final_step": 8, "last_committed_step": 8,
                      "last_committed_uri": CheckpointStore(str(a), "t").uri(8),
                      "train_loss": pytest.approx(sum(losses) / 8), "tokens_seen": 1024,
                      "steps_run": 8, "resumed_from": None}
    step_times = [ln["step_time_s"] for ln in lines if ln["type"] == "step"]
    assert throughput["step_time_s"] == pytest.approx(sum(step_times) / 8)
    assert throughput["tokens_per_s"] == pytest.approx(1024 / sum(step_times))
    assert throughput["peak_mem_bytes"] >= step["peak_mem_bytes"] > 0


def test_an_auto_spec_checkpoints_at_the_interval_the_workflow_passes(tmp_path, dataset_uri):
    store = tmp_path / "store"
    spec = write_spec(tiny_spec(store, **{"train.checkpoint_every": "auto",
                                          "train.checkpoint_every_min": 5}), tmp_path / "s.json")
    ok(run_segment(spec, dataset_uri, 8, tmp_path / "w1", extra=("--checkpoint-every", "3")))
    assert CheckpointStore(str(store), "t").list_committed() == [0, 3, 6, 8]
    start = read_jsonl(tmp_path / "w1" / "progress.jsonl")[0]
    assert start["checkpoint_every"] == 3  # the supervisor's hang watch reads it
    # run by hand, without the workflow's choice: the lower bound
    ok(run_segment(spec, dataset_uri, 16, tmp_path / "w2"))
    assert CheckpointStore(str(store), "t").list_committed() == [0, 3, 6, 8, 10, 15, 16]


def test_retry_of_a_finished_segment_exits_at_once_without_training(single, dataset_uri):
    root, a, _ = single
    workdir = root / "retry"
    start = time.monotonic()
    ok(run_segment(str(root / "a.json"), dataset_uri, 8, workdir, attempt=3))
    result = json.loads((workdir / "result.json").read_text())
    assert result["steps_run"] == 0 and result["final_step"] == 8
    assert result["last_committed_step"] == 8
    assert not (workdir / "progress.jsonl").exists()
    assert time.monotonic() - start < 30


def segment_direct(args: list[str], workdir: Path) -> subprocess.CompletedProcess:
    """The rank process itself (no torchrun), to see its own exit code."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "trainer.segment", *args, "--workdir",
                           str(workdir)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_missing_dataset_writes_error_json_and_exits_3(tmp_path):
    spec = write_spec(tiny_spec(tmp_path / "s"), tmp_path / "spec.json")
    missing = f"file://{tmp_path}/nope/MANIFEST.json"
    proc = segment_direct(["--spec", spec, "--dataset", missing, "--to-step", "4"], tmp_path / "w")
    assert proc.returncode == 3, proc.stderr[-3000:]
    error = json.loads((tmp_path / "w" / "error.json").read_text())
    assert error["type"] == "BadData" and "nope/MANIFEST.json" in error["message"]
    assert not (tmp_path / "w" / "result.json").exists()


def test_world_size_other_than_the_spec_is_bad_config(tmp_path, dataset_uri):
    spec = write_spec(tiny_spec(tmp_path / "s", **{"train.procs_per_node": 2}),
                      tmp_path / "spec.json")
    proc = segment_direct(["--spec", spec, "--dataset", dataset_uri, "--to-step", "4"],
                          tmp_path / "w")
    assert proc.returncode == 3
    error = json.loads((tmp_path / "w" / "error.json").read_text())
    assert error["type"] == "BadConfig" and "train.procs_per_node" in error["message"]


def test_malformed_spec_names_the_field(tmp_path, dataset_uri):
    raw = tiny_spec(tmp_path / "s").to_dict()
    raw["train"]["lr"] = -1.0
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    proc = segment_direct(["--spec", str(tmp_path / "spec.json"), "--dataset", dataset_uri,
                           "--to-step", "4"], tmp_path / "w")
    assert proc.returncode == 3
    assert "train.lr" in json.loads((tmp_path / "w" / "error.json").read_text())["message"]


PARENT = """
import subprocess, sys, time
child = subprocess.Popen(sys.argv[1:])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_rank_dies_when_its_parent_is_killed(tmp_path, dataset_uri):
    spec = write_spec(tiny_spec(tmp_path / "s", **{"train.total_steps": 100_000,
                                                   "train.segment_steps": 100_000,
                                                   "train.checkpoint_every": 50_000}),
                      tmp_path / "spec.json")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, sys.executable, "-m", "trainer.segment", "--spec", spec,
         "--dataset", dataset_uri, "--to-step", "100000", "--workdir", str(tmp_path / "w")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    child = int(parent.stdout.readline())
    progress = tmp_path / "w" / "progress.jsonl"
    deadline = time.monotonic() + 120
    while not (progress.exists() and '"step"' in progress.read_text()):
        assert time.monotonic() < deadline, "the segment never reached a training step"
        time.sleep(0.2)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(child):
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the rank outlived its parent")
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_corrupt_newest_checkpoint_is_reported_and_resume_falls_back(single, dataset_uri,
                                                                     tmp_path):
    _, a, _ = single
    store_dir = tmp_path / "store"
    shutil.copytree(a, store_dir)
    model_file = store_dir / CKPT.format(8) / "mp_rank_00_model_states.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, wrong checksum
    model_file.write_bytes(bytes(data))
    spec = write_spec(tiny_spec(store_dir), tmp_path / "spec.json")
    ok(run_segment(spec, dataset_uri, 12, tmp_path / "w", attempt=2))
    result = json.loads((tmp_path / "w" / "result.json").read_text())
    assert result["resumed_from"] == 4 and result["final_step"] == 12
    corrupt = read_events(str(store_dir), "t", kinds=("checkpoint_corrupt",))
    assert [(e["step"], e["payload"]["file"]) for e in corrupt] == [
        (8, "mp_rank_00_model_states.pt")]
    assert CheckpointStore(str(store_dir), "t").latest_committed() == 12


def test_resuming_with_a_different_model_shape_is_bad_config(single, dataset_uri, tmp_path):
    _, a, _ = single
    shutil.copytree(a, tmp_path / "store")
    spec = write_spec(tiny_spec(tmp_path / "store", **{"model.d_model": 64}),
                      tmp_path / "spec.json")
    proc = segment_direct(["--spec", spec, "--dataset", dataset_uri, "--to-step", "12"],
                          tmp_path / "w")
    assert proc.returncode == 3, proc.stderr[-3000:]
    error = json.loads((tmp_path / "w" / "error.json").read_text())
    assert error["type"] == "BadConfig" and "step 8 does not fit" in error["message"]


def test_packing_flag_chooses_packed_documents_or_fixed_windows(tmp_path, dataset_uri):
    from trainer.data import PackedBatches, TrainBatches
    from trainer.segment import make_batches

    packed = make_batches(tiny_spec(tmp_path), dataset_uri, 0, 1)
    windows = make_batches(tiny_spec(tmp_path, **{"train.packing": False}), dataset_uri, 0, 1)
    assert isinstance(packed, PackedBatches) and isinstance(windows, TrainBatches)
    assert len(packed.get(0)) == 4 and len(windows.get(0)) == 2


def test_bf16_zero1_with_overlap_comm_no_clipping_and_compiled_blocks_trains_on_cpu(
        tmp_path, dataset_uri):
    # model.compile compiles each block in place: the engine trains it, and the checkpoint
    # carries the eager parameter names, so turning compile off resumes the same run (the
    # names' equality and the numbers: tests/trainer/test_model.py)
    over = {"train.precision": "bf16", "train.zero_stage": 1, "train.overlap_comm": True,
            "train.grad_clip": 0.0, "train.checkpoint_every": 6, "model.compile": True}
    spec = write_spec(tiny_spec(tmp_path / "s", **over), tmp_path / "spec.json")
    ok(run_segment(spec, dataset_uri, 6, tmp_path / "w"))
    steps = [ln for ln in read_jsonl(tmp_path / "w" / "progress.jsonl") if ln["type"] == "step"]
    assert len(steps) == 6 and all(s["loss"] == s["loss"] for s in steps)  # finite, not NaN
    assert steps[-1]["loss"] < steps[0]["loss"]
    weights = load_tensors(tmp_path / "s" / CKPT.format(6) / "mp_rank_00_model_states.pt")
    assert weights["/module/embed.weight"].dtype == torch.bfloat16
    assert "/module/blocks.0.attn.wq.weight" in weights
    assert not any("_orig_mod" in k for k in weights)


def test_fp16_on_cpu_fails_fast_as_bad_config(tmp_path, dataset_uri):
    spec = write_spec(tiny_spec(tmp_path / "s", **{"train.precision": "fp16"}),
                      tmp_path / "spec.json")
    proc = segment_direct(["--spec", spec, "--dataset", dataset_uri, "--to-step", "4"],
                          tmp_path / "w")
    assert proc.returncode == 3, proc.stderr[-3000:]
    error = json.loads((tmp_path / "w" / "error.json").read_text())
    assert error["type"] == "BadConfig" and "train.precision" in error["message"]


def test_a_micro_split_run_trains_the_same_global_batch_to_the_same_weights(
        single, tmp_path, dataset_uri):
    # After an OOM the workflow runs each micro-batch as two halves: DeepSpeed
    # sees half the micro-batch and twice the accumulation, the data cursor and order are
    # untouched — so the weights match the unsplit run up to float reassociation, and a
    # checkpoint of one resumes under the other.
    root, a, _ = single  # the unsplit run: 8 steps of 4 sequences of 32, ZeRO 0
    b = tmp_path / "b"
    spec_b = write_spec(tiny_spec(b, **{"train.zero_stage": 0}), tmp_path / "b.json")
    ok(run_segment(spec_b, dataset_uri, 4, tmp_path / "wb1", extra=("--micro-split", "2")))
    ok(run_segment(spec_b, dataset_uri, 8, tmp_path / "wb2", extra=("--micro-split", "4")))
    ma, mb = (CheckpointStore(str(x), "t").manifest(8) for x in (a, b))
    assert (ma.data_cursor, ma.tokens_seen) == (mb.data_cursor, mb.tokens_seen) == (8, 8 * 128)
    wa = load_tensors(a / CKPT.format(8) / "mp_rank_00_model_states.pt")
    wb = load_tensors(b / CKPT.format(8) / "mp_rank_00_model_states.pt")
    # Adam divides by sqrt(v): float-order differences in tiny gradients grow a little, so
    # the measure is against what training moved the weights by, not bitwise
    w4 = load_tensors(a / CKPT.format(4) / "mp_rank_00_model_states.pt")
    module = [k for k in wa if k.startswith("/module/")]
    drift = max((wa[k] - wb[k]).abs().max().item() for k in module)
    moved = max((wa[k] - w4[k]).abs().max().item() for k in module)
    assert module and moved > 0 and drift < 1e-3 * moved, (drift, moved)
    losses = [[p["loss"] for p in read_jsonl(w / "progress.jsonl") if p["type"] == "step"]
              for w in (root / "wa", tmp_path / "wb2")]
    assert losses[0][4:] == pytest.approx(losses[1], rel=1e-4)


def test_a_micro_split_that_does_not_divide_the_micro_batch_is_refused_naming_the_flag(
        tmp_path, dataset_uri):
    spec = write_spec(tiny_spec(tmp_path / "s"), tmp_path / "s.json")  # 4 sequences of 32
    proc = run_segment(spec, dataset_uri, 2, tmp_path / "w", extra=("--micro-split", "3"))
    assert proc.returncode != 0  # torchrun exits 1 whatever its rank's code (3) was
    err = json.loads((tmp_path / "w" / "error.json").read_text())
    assert err["type"] == "BadConfig" and "--micro-split" in err["message"]


# ---- train.init_from: a fresh run starts from another run's promoted weights -------------
def promoted(store: Path, step: int) -> Path:
    CheckpointStore(str(store), "t").promote(step)
    return store / "runs" / "t" / "promoted" / f"step-{step:09d}"


def test_a_run_from_a_promoted_checkpoint_starts_with_its_weights_and_its_loss(single,
                                                                                 dataset_uri):
    root, a, _ = single
    source = promoted(a, 8)
    # at two ranks of one node: both fetch the source beside each other into one workdir
    spec = write_spec(tiny_spec(a, **{"run_id": "t-child", "train.init_from": "t@8",
                                      "train.checkpoint_every": 2, "train.procs_per_node": 2}),
                      root / "child.json")
    ok(run_segment(spec, dataset_uri, 2, root / "wc", world=2))
    theirs = load_tensors(source / "mp_rank_00_model_states.pt")
    mine = load_tensors(a / "runs/t-child/checkpoints/step-000000000/mp_rank_00_model_states.pt")
    weights = [k for k in theirs if k.startswith("/module/")]
    assert weights and all(torch.equal(theirs[k], mine[k]) for k in weights)  # exactly
    parent = [ln["loss"] for ln in read_jsonl(root / "wa" / "progress.jsonl")
              if ln["type"] == "step"]
    child = [ln["loss"] for ln in read_jsonl(root / "wc" / "progress.jsonl")
             if ln["type"] == "step"]
    # where the parent ended (its first batch, seen by the parent, even lower), not where
    # a fresh model starts
    assert child[0] < parent[-1] + 0.25 * (parent[0] - parent[-1]), (parent, child)


def test_a_pickle_payload_in_the_promoted_checkpoint_is_refused_never_run(single, tmp_path):
    from storage.manifest import CheckpointManifest, FileEntry
    from tests.trainer.helpers import VOCAB
    from tests.trainer.test_safe_load import plant
    from trainer.init_from import load_init_weights
    from trainer.model import GPT

    _, a, _ = single
    store = tmp_path / "store"
    shutil.copytree(a / "runs" / "t", store / "runs" / "t")
    source = promoted(store, 8)
    marker = tmp_path / "pwned"
    victim = source / "mp_rank_00_model_states.pt"
    plant(victim, marker, "module")
    # a bucket writer rewrites the manifest too, so the file passes its checksum
    man = CheckpointManifest.from_json((source / "MANIFEST.json").read_text(), step=8)
    blob = victim.read_bytes()
    entry = FileEntry(size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (source / "MANIFEST.json").write_text(
        dataclasses.replace(man, files={**man.files, victim.name: entry}).to_json())
    spec = tiny_spec(store, **{"run_id": "t-child", "train.init_from": "t"})
    model = GPT(spec.model, VOCAB, seed=0)
    with pytest.raises(BadData) as err:
        load_init_weights(model, spec, str(tmp_path / "w"))
    assert "cannot be loaded" in err.value.problem and "t" in err.value.problem
    assert not marker.exists()
