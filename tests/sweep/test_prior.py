"""Step Law's learning rate (sweep/prior.py) on hand-computed values."""

import math

import pytest

from spec import preset
from sweep.prior import non_embedding_params, planned_tokens, prior_lr, step_law_lr


def test_step_law_at_a_million_params_and_a_billion_tokens():
    # 1.79 · (1e6)^-0.713 · (1e9)^0.307 = 1.79 · 10^(-4.278 + 2.763) = 1.79 · 10^-1.515
    assert step_law_lr(1e6, 1e9) == pytest.approx(0.054683, rel=1e-4)


def test_step_law_lr_falls_with_size_and_rises_with_tokens():
    assert step_law_lr(1e8, 1e9) < step_law_lr(1e6, 1e9) < step_law_lr(1e6, 1e10)
    with pytest.raises(ValueError):
        step_law_lr(0, 1e9)


def test_the_demo_models_non_embedding_params_counted_by_hand():
    # d 128, 2 layers, 4 heads = 4 kv heads: attention 4·128², SwiGLU hidden
    # ceil(4·128·2/3 / 64)·64 = 384 → 3·128·384, two norms 2·128; plus the final norm
    spec = preset("demo")
    assert non_embedding_params(spec.model) == 2 * (4 * 128**2 + 3 * 128 * 384 + 256) + 128
    assert planned_tokens(spec) == 240 * 1024  # 240 steps of one 1,024-token micro-batch
    assert math.isclose(prior_lr(spec), step_law_lr(426_624, 245_760))


def test_the_count_matches_the_trainers_model_less_its_tied_embedding():
    from trainer.model import GPT

    spec = preset("demo").replace(**{"model.n_kv_heads": 2, "model.n_layers": 3})
    model = GPT(spec.model, vocab_size=512)
    assert non_embedding_params(spec.model) == model.param_count() - 512 * spec.model.d_model
