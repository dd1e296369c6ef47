"""The `corrupt_grad` fault (trainer/faults.py): one gradient element NaN on one rank, once,
inside that rank's optimizer step. In-process on a SkippableAdamW, then in the real segment
at world size 2 (gloo, ZeRO 0, two torchrun ranks): after the gradient all-reduce, so only
the named rank's copy of the weights goes bad, and the guard finds it
(trainer/replicas.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from common.errors import BadConfig
from spec import FaultSpec
from storage.events import read_events
from tests.trainer.helpers import run_segment, tiny_spec, write_spec
from trainer.faults import FaultInjector
from trainer.optim import SkippableAdamW

VOCAB = 64
AT_STEP = 3


class Source:
    def get(self, cursor: int) -> tuple[torch.Tensor, ...]:
        return (torch.full((1, 2), float(cursor + 1)),)


def train(rank: int, fault_rank: int, steps: int = 4, veto: tuple[int, ...] = (),
          bit: int = -1) -> tuple[FaultInjector, list[torch.Tensor]]:
    """`steps` steps of a linear model with the injector wired as segment.py wires it:
    the batch source (arms the fault at its step) and the model (`attach`). The weights
    after each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    opt = SkippableAdamW(model.parameters(), lr=0.1)
    inj = FaultInjector([FaultSpec(kind="corrupt_grad", at_step=AT_STEP, rank=fault_rank,
                                   bit=bit)],
                        batches_per_step=1, vocab_size=VOCAB, seed=1, rank=rank)
    inj.attach(model)
    batches, after = inj.batches(Source()), []
    try:
        for step in range(1, steps + 1):
            (x,) = batches.get(step - 1, step)
            model(x).pow(2).mean().backward()
            opt.veto = step in veto
            opt.step()
            opt.zero_grad()
            after.append(model.weight.detach().clone())
    finally:
        inj.grad_hook.remove()  # the pre-hook is process-wide
    return inj, after


def test_the_named_rank_updates_with_one_nan_element_at_its_step_once():
    inj, after = train(rank=1, fault_rank=1)
    assert all(torch.isfinite(w).all() for w in after[:AT_STEP - 1])
    bad = torch.isnan(after[AT_STEP - 1])
    assert int(bad.sum()) == 1  # one element, the largest gradient's
    assert ("corrupt_grad", AT_STEP) in inj.fired and inj.grad_armed is None


def test_with_a_bit_the_update_is_finite_and_differs_from_a_healthy_ranks():
    inj, flipped = train(rank=1, fault_rank=1, bit=10)
    _, healthy = train(rank=0, fault_rank=1, bit=10)
    assert all(torch.isfinite(w).all() for w in flipped)
    assert torch.equal(flipped[AT_STEP - 2], healthy[AT_STEP - 2])
    moved = flipped[AT_STEP - 1] != healthy[AT_STEP - 1]
    assert int(moved.sum()) == 1  # the one element whose gradient lost a bit
    gap = (flipped[AT_STEP - 1] - healthy[AT_STEP - 1]).abs().max()
    assert 0 < gap < 1e-2  # a wrong value no loss would show
    assert ("corrupt_grad", AT_STEP) in inj.fired


def test_another_rank_is_left_alone():
    inj, after = train(rank=0, fault_rank=1)
    assert all(torch.isfinite(w).all() for w in after)
    assert not inj.fired


def test_a_vetoed_update_keeps_it_armed_for_the_next_update():
    _, after = train(rank=0, fault_rank=0, veto=(AT_STEP,))
    assert torch.isfinite(after[AT_STEP - 1]).all()  # the skipped step would discard it
    assert int(torch.isnan(after[AT_STEP]).sum()) == 1


def test_a_replayed_step_after_a_rollback_does_not_fire_again():
    inj, _ = train(rank=0, fault_rank=0)
    inj.starting(AT_STEP + 1)
    inj.starting(AT_STEP)  # the step again, after a rollback
    assert inj.grad_armed is None


def test_the_rank_defaults_to_torchruns(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    inj = FaultInjector([], batches_per_step=1, vocab_size=VOCAB, seed=1)
    assert inj.rank == 1


def test_a_spec_names_a_rank_the_run_has():
    two = tiny_spec(Path("/tmp"), **{"train.procs_per_node": 2})
    fault = {"kind": "corrupt_grad", "at_step": 2}
    assert two.replace(faults=[{**fault, "rank": 1}]).faults[0].rank == 1
    for bad in (-1, 2):
        with pytest.raises(BadConfig, match="rank"):
            two.replace(faults=[{**fault, "rank": bad}])


@pytest.mark.e2e
def test_at_two_ranks_the_corrupted_ranks_copy_is_named_rolled_back_and_no_data_skipped(
        tmp_path, dataset_uri):
    """The real segment at world size 2 (DeepSpeed ZeRO 0, gloo): rank 1's update at step
    AT_STEP + 2 goes NaN after the gradient all-reduce, so only its copy of the weights
    breaks. The next loss is NaN; the guard compares the ranks' copies before it decides,
    names rank 1 (the one holding non-finite values; two ranks have no majority), rolls back
    with a `numerics` verdict that replays nothing and skips no data, and every copy agrees
    again after the restore. The run ends healthy."""
    at = AT_STEP + 2  # after the first commit (every 4 steps)
    spec = tiny_spec(tmp_path / "store", **{"train.procs_per_node": 2}).replace(
        faults=[{"kind": "corrupt_grad", "at_step": at, "rank": 1}])
    proc = run_segment(write_spec(spec, tmp_path / "spec.json"), dataset_uri, 12,
                       tmp_path / "w", world=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    events = read_events(spec.storage.durable, spec.run_id)
    (diagnosed,) = [e["payload"] for e in events if e["kind"] == "spike_diagnosed"]
    assert diagnosed["verdict"] == "numerics" and diagnosed["source"] == "replicas"
    assert diagnosed["ranks"] == [1] and diagnosed["node_ranks"] == [0]
    assert diagnosed["nonfinite"][0] == 0 < diagnosed["nonfinite"][1]
    assert diagnosed["forward_passes"] == 0 and diagnosed["agree_after_restore"] is True
    (rollback,) = [e["payload"] for e in events if e["kind"] == "rollback"]
    assert rollback["verdict"] == "numerics" and rollback["skipped"] == "nothing"
    assert rollback["reason"] == "replicas_disagree" and rollback["at_step"] == at + 1
    result = json.loads((tmp_path / "w" / "result.json").read_text())
    assert result["outcome"]["suspects"] == [{"step": at + 1, "ranks": [1], "node_ranks": [0]}]
    assert result["final_step"] == 12 and math.isfinite(result["train_loss"])


@pytest.mark.e2e
def test_a_flipped_bit_no_loss_shows_is_caught_before_its_checkpoint_commits(tmp_path,
                                                                           dataset_uri):
    """The real segment at world size 3 (ZeRO 0, gloo): one bit of rank 1's largest gradient
    element flips at step AT_STEP + 3, after the all-reduce, so its copy of the weights is
    off by ~1e-4 in one element and no loss moves. Before the step-8 checkpoint commits,
    the ranks compare their copies (the fingerprint), the majority names rank 1, and the
    segment rolls back to step 4 rather than commit, and train on, a corrupted replica:
    `numerics`, no loss spike, nothing replayed or skipped. The run ends healthy, its
    copies equal."""
    at = AT_STEP + 3  # between the commits of steps 4 and 8 (every 4 steps)
    spec = tiny_spec(tmp_path / "store", **{"train.procs_per_node": 3}).replace(
        faults=[{"kind": "corrupt_grad", "at_step": at, "rank": 1, "bit": 10}])
    proc = run_segment(write_spec(spec, tmp_path / "spec.json"), dataset_uri, 12,
                       tmp_path / "w", world=3)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    events = read_events(spec.storage.durable, spec.run_id)
    assert not [e for e in events if e["kind"] in ("loss_spike", "batch_skipped")]
    (diagnosed,) = [e["payload"] for e in events if e["kind"] == "spike_diagnosed"]
    assert diagnosed["verdict"] == "numerics" and diagnosed["source"] == "replicas"
    assert diagnosed["ranks"] == [1] and diagnosed["nonfinite"] == [0, 0, 0]
    assert diagnosed["forward_passes"] == 0 and diagnosed["agree_after_restore"] is True
    (rollback,) = [e["payload"] for e in events if e["kind"] == "rollback"]
    assert rollback["reason"] == "replicas_disagree_at_commit"
    assert (rollback["at_step"], rollback["to_step"]) == (8, 4)
    assert rollback["skipped"] == "nothing"
    committed = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert committed.count(8) == 1 and committed[-1] == 12  # step 8 only once, re-trained
    result = json.loads((tmp_path / "w" / "result.json").read_text())
    assert result["outcome"]["suspects"] == [{"step": 8, "ranks": [1], "node_ranks": [0]}]
    assert result["final_step"] == 12 and math.isfinite(result["train_loss"])
