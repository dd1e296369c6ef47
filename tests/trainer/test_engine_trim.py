"""What trainer/engine.py takes out of DeepSpeed's plain fp32 step (ZeRO 0): the gradient
all-reduce over a data-parallel group of one, and the second gradient norm (DeepSpeed's
clipping keeps the norm it computed). Same gradients, same updates, bit for bit, as the
engine DeepSpeed builds; run in a child process (DeepSpeed on CPU, world size 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import run_rank_module, tiny_spec
from trainer.model import GPT

pytestmark = pytest.mark.process  # it starts processes (tests/conftest.py)

VOCAB = 64


def child() -> dict:
    """Run this module's __main__ as one DeepSpeed rank on CPU; its RESULT line."""
    return run_rank_module("tests.trainer.test_engine_trim")


def test_the_trimmed_engine_updates_bitwise_as_deepspeeds_and_keeps_the_clip_norm():
    out = child()
    assert out["allreduce"] == [False, True]  # trimmed, as DeepSpeed built it
    assert out["weights_equal"], out
    # the kept norm is the pre-clip norm the probe measured before (clipping is active)
    assert all(n > 0.05 for n in out["expected_norms"])
    assert out["kept_norms"] == pytest.approx(out["expected_norms"], rel=1e-5)
    assert out["kept_norms"] == out["deepspeed_norms"]  # its own arithmetic, bit for bit
    assert out["untrimmed_norm"] is None  # DeepSpeed alone keeps none at ZeRO 0 in fp32


# ---- the child process ------------------------------------------------------------------------
def _engines():
    from trainer.engine import build_engine

    spec = tiny_spec(Path("/tmp"), **{"train.grad_clip": 0.05})
    trimmed = build_engine(spec, GPT(spec.model, VOCAB, seed=0))
    plain = build_engine(spec, GPT(spec.model, VOCAB, seed=0))
    plain.enable_backward_allreduce = True  # undo the trim: DeepSpeed's own step
    del plain.clip_fp32_gradients
    return trimmed, plain


def _main() -> dict:
    import deepspeed
    from deepspeed.runtime.utils import clip_grad_norm_

    from trainer.step_metrics import grad_norm

    deepspeed.init_distributed(dist_backend="gloo")
    trimmed, plain = _engines()
    g = torch.Generator().manual_seed(7)
    kept, expected, theirs = [], [], []
    for _ in range(3):
        x = torch.randint(0, VOCAB, (4, 32), generator=g)
        for engine in (trimmed, plain):
            _, loss = engine(x, x)
            engine.backward(loss)
            if engine is plain:
                expected.append(float(grad_norm(engine.module.parameters())))
                # DeepSpeed's own function (scales by min(1, 1e9 / norm) = 1: unchanged)
                theirs.append(float(clip_grad_norm_(engine.module.parameters(), 1e9)))
            engine.step()
        kept.append(float(trimmed.get_global_grad_norm()))
    same = all(torch.equal(a, b) for a, b in zip(trimmed.module.parameters(),
                                                 plain.module.parameters()))
    return {"allreduce": [trimmed.enable_backward_allreduce, plain.enable_backward_allreduce],
            "weights_equal": same, "kept_norms": kept,
            "expected_norms": expected, "deepspeed_norms": theirs,
            "untrimmed_norm": plain.get_global_grad_norm()}


if __name__ == "__main__":
    print("RESULT " + json.dumps(_main()))
