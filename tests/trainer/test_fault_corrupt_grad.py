"""The `corrupt_grad` fault (trainer/faults.py): one gradient element NaN on one rank, once,
inside that rank's optimizer step. In-process on a SkippableAdamW, then on the real
DeepSpeed engine at world size 2 (gloo, ZeRO 0, two torchrun ranks): after the gradient
all-reduce, so only the named rank's weights go bad."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import BadConfig
from spec import FaultSpec
from tests.trainer.helpers import REPO, tiny_spec
from trainer.faults import FaultInjector
from trainer.optim import SkippableAdamW

VOCAB = 64
AT_STEP = 3


class Source:
    def get(self, cursor: int) -> tuple[torch.Tensor, ...]:
        return (torch.full((1, 2), float(cursor + 1)),)


def train(rank: int, fault_rank: int, steps: int = 4, veto: tuple[int, ...] = ()
          ) -> tuple[FaultInjector, list[torch.Tensor]]:
    """`steps` steps of a linear model with the injector wired as segment.py wires it:
    the batch source (arms the fault at its step) and the model (`attach`). The weights
    after each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    opt = SkippableAdamW(model.parameters(), lr=0.1)
    inj = FaultInjector([FaultSpec(kind="corrupt_grad", at_step=AT_STEP, rank=fault_rank)],
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


def test_on_deepspeed_at_two_ranks_only_the_named_ranks_weights_go_bad(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    out = tmp_path / "ranks.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "tests.trainer.test_fault_corrupt_grad", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    # before the fault's step both ranks hold the same finite weights
    assert ranks["0"]["nan_after"][:AT_STEP - 1] == ranks["1"]["nan_after"][:AT_STEP - 1] == \
        [0] * (AT_STEP - 1)
    assert ranks["0"]["same_before"]
    # at its step rank 1 updated with one NaN element and rank 0, after the same
    # all-reduce, did not (corrupting before the reduction would have reached both)
    assert ranks["1"]["nan_after"][AT_STEP - 1] == 1
    assert ranks["0"]["nan_after"][AT_STEP - 1] == 0


# ---- the torchrun ranks ---------------------------------------------------------------------
def _rank_main(out: str) -> None:
    import deepspeed
    import torch.distributed as dist

    from trainer.engine import build_engine
    from trainer.model import GPT

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    spec = tiny_spec(Path("/tmp"), **{"train.procs_per_node": 2})
    engine = build_engine(spec, GPT(spec.model, VOCAB, seed=0))
    inj = FaultInjector([FaultSpec(kind="corrupt_grad", at_step=AT_STEP, rank=1)],
                        batches_per_step=1, vocab_size=VOCAB, seed=1)  # rank: the group's
    inj.attach(engine.module)
    g = torch.Generator().manual_seed(rank)  # each rank its own data, as in training
    nan_after, same_before = [], True
    for step in range(1, AT_STEP + 1):
        inj.starting(step)
        x = torch.randint(0, VOCAB, (4, 32), generator=g)
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        flat = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
        nan_after.append(int(torch.isnan(flat).sum()))
        if step < AT_STEP:
            both = [torch.zeros_like(flat) for _ in range(2)]
            dist.all_gather(both, flat)
            same_before &= torch.equal(both[0], both[1])
    everyone: list = [None, None]
    dist.all_gather_object(everyone, {"nan_after": nan_after, "same_before": same_before})
    if rank == 0:
        Path(out).write_text(json.dumps({str(r): v for r, v in enumerate(everyone)}))
    dist.barrier()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
