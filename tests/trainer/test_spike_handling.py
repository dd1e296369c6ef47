"""Spike handling inside a real DeepSpeed segment (CPU, gloo): skip, rollback, skip window,
online evaluation. Each fault is injected through the run spec (trainer/faults.py)."""

from __future__ import annotations

import json

import pytest
import torch

from storage.checkpoints import CheckpointStore
from storage.events import read_events
from tests.trainer.helpers import run_segment, tiny_spec, write_spec
from trainer.optim import SkippableAdamW
from trainer.state import TrainState, state_file

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

# Fast-learning tiny run: by step 70 the loss is ~3 nats, a random-token batch ~7.
SPIKY = {"train.total_steps": 100, "train.segment_steps": 100, "train.lr": 0.01,
         "train.min_lr": 0.001, "train.checkpoint_every": 5, "train.eval_every": 10,
         "spikes.window": 20, "spikes.warmup": 10, "spikes.skip_window": 8}
CORRUPT_AT, CORRUPT_STEPS, NAN_AT = 76, 4, 22


def steps_of(workdir) -> list[dict]:
    lines = [json.loads(line) for line in (workdir / "progress.jsonl").read_text().splitlines()]
    return [p for p in lines if p["type"] == "step"]


def spiky_segment(root, dataset_uri: str, world: int = 1, **layout) -> tuple:
    """One 100-step segment with corrupted batches at steps 76-79 and a NaN loss at 22, on
    `world` ranks with `layout`'s overrides (TP, PP): (spec, its result.json)."""
    spec = tiny_spec(root / "store", **SPIKY, **layout, faults=[
        {"kind": "corrupt_batches", "at_step": CORRUPT_AT, "steps": CORRUPT_STEPS},
        {"kind": "nan_loss", "at_step": NAN_AT}])
    proc = run_segment(write_spec(spec, root / "spec.json"), dataset_uri, 100, root / "work",
                       world=world)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return spec, json.loads((root / "work" / "result.json").read_text())


@pytest.fixture(scope="module")
def spiky(tmp_path_factory, dataset_uri):
    root = tmp_path_factory.mktemp("spiky")
    spec, result = spiky_segment(root, dataset_uri)
    return spec, root, result


def test_sustained_spike_rolls_back_to_a_checkpoint_before_its_onset(spiky):
    spec, root, result = spiky
    (rb,) = result["outcome"]["rollbacks"]
    assert rb["onset"] == CORRUPT_AT
    assert rb["to_step"] < CORRUPT_AT and rb["to_step"] % spec.train.checkpoint_every == 0
    assert result["final_step"] == 100 and result["train_loss"] < 4.0
    # the steps from the onset ran twice: first as outliers, then on clean data
    replays = [p for p in steps_of(root / "work") if p["step"] == CORRUPT_AT]
    assert [p["verdict"] for p in replays] == ["skip", "ok"]
    assert replays[0]["loss"] > replays[1]["loss"] + 2.0


def test_skip_window_covers_the_bad_batches_and_is_committed_and_honoured(spiky):
    spec, root, result = spiky
    (rb,) = result["outcome"]["rollbacks"]
    start, end = rb["skip"]
    bad = ((CORRUPT_AT - 1), (CORRUPT_AT - 1 + CORRUPT_STEPS))  # cursors those steps read
    assert start <= bad[0] and bad[1] <= end
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    assert store.manifest(100).skip_ranges == ((start, end),)
    assert store.manifest(rb["to_step"]).skip_ranges == ()  # written before the spike
    state = TrainState.load(str(root / "work" / "ckpt" / "step-000000100" / state_file(0)))
    # replay from to_step (cursor == to_step: nothing skipped before) stepped over the rest
    assert state.data_cursor == 100 + end - max(start, rb["to_step"])
    assert state.skip_ranges == [(start, end)]


def test_nan_loss_is_skipped_without_touching_the_weights(spiky):
    _, root, result = spiky
    assert NAN_AT in result["outcome"]["skipped_steps"]
    nan_step = next(p for p in steps_of(root / "work") if p["step"] == NAN_AT)
    assert nan_step["loss"] is None and nan_step["verdict"] == "skip"
    after = [p["loss"] for p in steps_of(root / "work") if p["step"] > NAN_AT]
    assert all(x is not None for x in after)  # a NaN update would have poisoned every step


def test_every_decision_is_an_event_with_its_evidence(spiky):
    spec, _, result = spiky
    events = read_events(spec.storage.durable, spec.run_id)
    kinds = [e["kind"] for e in events]
    faults = {e["payload"]["kind"] for e in events if e["kind"] == "fault"}
    assert faults == {"corrupt_batches", "nan_loss"}
    (rb,) = [e["payload"] for e in events if e["kind"] == "rollback"]
    assert rb["reason"] == "sustained_spike" and rb["onset"] == CORRUPT_AT
    assert rb["loss"] > rb["threshold"] > rb["baseline"] and rb["spread"] > 0
    assert rb["outlier_steps"][0] == CORRUPT_AT and rb["skip"] == result["outcome"]["rollbacks"][0]["skip"]
    assert rb["skipped"] == "window" and rb["verdict"] == "data"  # bad batches: the window
    spikes = [e["payload"] for e in events if e["kind"] == "loss_spike"]
    assert len(spikes) >= spec.spikes.patience
    skipped = [e["payload"] for e in events if e["kind"] == "batch_skipped"]
    assert {"non_finite_loss", "outlier"} <= {s["reason"] for s in skipped}
    assert kinds.index("rollback") > kinds.index("loss_spike")
    # replayed on the restored weights, twice: the corrupted batches are the cause
    (diag,) = [e["payload"] for e in events if e["kind"] == "spike_diagnosed"]
    assert diag["verdict"] == "data" and diag["replay_disagreement"] == 0.0
    bad = set(range(CORRUPT_AT - 1, CORRUPT_AT - 1 + CORRUPT_STEPS))  # their cursors
    assert set(diag["batches"]) == bad
    assert min(diag["spike_batch_losses"]) > diag["threshold"]
    assert diag["steps_worth"] <= 10 and diag["replay_s"] > 0


def test_online_evaluation_reports_held_out_loss_every_interval(spiky):
    spec, _, result = spiky
    evals = result["outcome"]["evals"]
    assert [e[0] for e in evals] == list(range(10, 101, 10))
    assert evals[-1][2] < evals[0][2] - 1.0  # the held-out loss fell
    events = read_events(spec.storage.durable, spec.run_id, kinds=("eval",))
    assert sorted(e["step"] for e in events) == [e[0] for e in evals]


def test_rollback_beyond_the_allowance_ends_the_segment_at_the_restored_step(tmp_path,
                                                                             dataset_uri):
    spec = tiny_spec(tmp_path / "store", **SPIKY, faults=[
        {"kind": "corrupt_batches", "at_step": CORRUPT_AT, "steps": CORRUPT_STEPS}])
    proc = run_segment(write_spec(spec, tmp_path / "spec.json"), dataset_uri, 100,
                       tmp_path / "work", extra=("--max-rollbacks", "0"))
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = json.loads((tmp_path / "work" / "result.json").read_text())
    (rb,) = result["outcome"]["rollbacks"]
    assert result["outcome"]["stopped"] == "rollback_budget"
    assert result["final_step"] == rb["to_step"] == result["last_committed_step"]
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    assert store.latest_committed() == rb["to_step"]  # the spiked trajectory was uncommitted
    # The next segment resumes from that checkpoint, written before the window was decided,
    # and still steps over the bad data (the window is in the run's event log).
    proc = run_segment(str(tmp_path / "spec.json"), dataset_uri, 100, tmp_path / "next")
    assert proc.returncode == 0, proc.stdout[-3000:]
    again = json.loads((tmp_path / "next" / "result.json").read_text())
    assert again["resumed_from"] == rb["to_step"] and again["final_step"] == 100
    assert again["outcome"]["rollbacks"] == [] and again["outcome"]["skipped_steps"] == []
    assert store.manifest(100).skip_ranges == (tuple(rb["skip"]),)


def test_with_handling_off_an_injected_nan_poisons_the_run(tmp_path, dataset_uri):
    spec = tiny_spec(tmp_path / "store", **{**SPIKY, "train.total_steps": 30,
                                            "train.segment_steps": 30, "train.eval_every": 0},
                     **{"spikes.enabled": False}, faults=[{"kind": "nan_loss", "at_step": NAN_AT}])
    proc = run_segment(write_spec(spec, tmp_path / "spec.json"), dataset_uri, 30, tmp_path / "work")
    assert proc.returncode == 0, proc.stdout[-3000:]
    losses = [p["loss"] for p in steps_of(tmp_path / "work")]
    assert all(x is not None for x in losses[:NAN_AT - 1])
    assert all(x is None for x in losses[NAN_AT - 1:])  # NaN weights from the step on


def test_vetoed_adamw_step_leaves_weights_moments_and_step_count_unchanged():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = SkippableAdamW([w], lr=0.1, weight_decay=0.1)
    (w.sum() ** 2).backward()
    opt.step()
    before = (w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()})
    (w.sum() ** 3).backward()
    opt.veto = True
    opt.step()
    assert torch.equal(w, before[0])
    assert all(torch.equal(opt.state[w][k], v) for k, v in before[1].items())
    assert opt.vetoed == 1 and not opt.veto
    opt.step()  # the veto is for one step only
    assert not torch.equal(w, before[0])


def test_world_size_two_zero2_ranks_agree_on_the_rollback_and_finish(tmp_path, dataset_uri):
    spec = tiny_spec(tmp_path / "store", **SPIKY, **{"train.procs_per_node": 2,
                                                     "train.zero_stage": 2}, faults=[
        {"kind": "corrupt_batches", "at_step": CORRUPT_AT, "steps": CORRUPT_STEPS}])
    proc = run_segment(write_spec(spec, tmp_path / "spec.json"), dataset_uri, 100,
                       tmp_path / "work", world=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "work" / "result.json").read_text())
    (rb,) = result["outcome"]["rollbacks"]
    assert rb["onset"] == CORRUPT_AT and result["final_step"] == 100
    store = CheckpointStore(spec.storage.durable, spec.run_id)
    assert store.manifest(100).skip_ranges == (tuple(rb["skip"]),)
    # both ranks restored the same step and stepped over the same window
    states = [TrainState.load(str(tmp_path / "work" / "ckpt" / "step-000000100" / state_file(r)))
              for r in (0, 1)]
    assert states[0].data_cursor == states[1].data_cursor and states[0].step == 100
