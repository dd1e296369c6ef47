"""The oscillation detector, the gradient noise scale and the remedy (trainer/oscillation.py),
pure, on literal series and hand-worked numbers."""

from __future__ import annotations

import math

import pytest

from spec.spikes import OscillationConfig
from trainer.oscillation import (
    MAD_TO_SIGMA,
    OscillationState,
    noise_scale,
    observe,
    remedy,
    residual_variance,
    theil_sen,
)

CFG = OscillationConfig(window=16, warmup=8, references=2, ratio=9.0, min_spread=0.005)


def curve(n: int, wobble=lambda i: 0.01 * (-1) ** i) -> list[float]:
    """A decaying loss, from 5 towards 2, with a step-to-step wobble."""
    return [2.0 + 3.0 * math.exp(-i / 200) + wobble(i) for i in range(n)]


def readings(losses: list[float], cfg: OscillationConfig = CFG):
    state, out = OscillationState(), []
    for step, loss in enumerate(losses, start=1):
        state, reading = observe(state, step, loss, cfg)
        if reading is not None:
            out.append(reading)
    return out


def test_a_clean_decaying_curve_never_triggers():
    found = readings(curve(200))
    assert len(found) >= 8  # judged all along
    assert not any(r.oscillating for r in found)
    assert max(r.ratio for r in found) < 3


def test_a_curve_that_starts_to_shake_triggers_on_its_first_shaking_block():
    losses = curve(200, lambda i: (0.01 if i < 104 else 0.05) * (-1) ** i)
    found = readings(losses)
    first = next(r for r in found if r.oscillating)
    # blocks of 16 after 8 warm-up losses: steps 9-24, 25-40, ...; the shaking starts at 105
    assert (first.start, first.step) == (105, 120)
    assert 15 < first.ratio < 30  # about (0.05 / 0.01)^2
    assert not any(r.oscillating for r in found if r.step < 120)


def test_a_single_spike_does_not_trigger():
    losses = curve(200)
    losses[110] += 3.0  # one outlier (the spike detector's business)
    assert not any(r.oscillating for r in readings(losses))


def test_a_shaking_block_does_not_become_the_reference():
    losses = curve(300, lambda i: (0.01 if i < 104 else 0.05) * (-1) ** i)
    shaking = [r for r in readings(losses) if r.start >= 105]
    assert len(shaking) == 12 and all(r.oscillating for r in shaking)  # it stays flagged
    # against the six calm blocks alone (the floor falls with the loss level)
    assert max(r.reference for r in shaking) <= shaking[0].reference


def test_no_judgement_during_warmup_or_before_enough_reference_blocks():
    losses = curve(8 + 16 * 2)  # warm-up and the two reference blocks only
    assert readings(losses) == []


def test_the_reference_is_floored_so_a_perfectly_flat_history_is_not_divided_by_zero():
    flat = [3.0] * 40 + [3.0 + 0.001 * (-1) ** i for i in range(16)]
    (r,) = readings(flat)
    assert r.reference == pytest.approx((0.005 * 3.0) ** 2)  # min_spread x the loss level
    assert not r.oscillating


def test_theil_sen_fits_a_line_despite_an_outlier_and_the_residual_variance_ignores_a_trend():
    line = [1.0 + 0.5 * i for i in range(10)]
    assert theil_sen(line) == pytest.approx((1.0, 0.5))
    assert residual_variance(line) == pytest.approx(0.0)
    line[4] = 100.0
    assert theil_sen(line) == pytest.approx((1.0, 0.5))
    wobble = [5.0 - 0.1 * i + 0.2 * (-1) ** i for i in range(16)]
    assert residual_variance(wobble) == pytest.approx((MAD_TO_SIGMA * 0.2) ** 2, rel=0.05)


# ---- the gradient noise scale (McCandlish et al. 2018, A.1) ------------------------------
def test_the_noise_scale_recovers_hand_worked_gradient_and_trace():
    # |G|^2 = 4, tr(Sigma) = 64: E|G_4|^2 = 4 + 64/4 = 20, E|G_32|^2 = 4 + 64/32 = 6
    found = noise_scale(20.0, 6.0, b_small=4, b_big=32)
    assert found.gradient_sq == pytest.approx(4.0)  # (32*6 - 4*20) / 28
    assert found.trace == pytest.approx(64.0)  # (20 - 6) / (1/4 - 1/32)
    assert found.b_simple == pytest.approx(16.0)


def test_a_non_positive_gradient_estimate_is_an_infinite_noise_scale_and_no_noise_is_none():
    assert noise_scale(20.0, 2.0, b_small=4, b_big=32).b_simple == math.inf  # (64-80)/28 < 0
    assert noise_scale(5.0, 5.0, b_small=4, b_big=32) is None  # no spread between sizes
    assert noise_scale(20.0, 6.0, b_small=4, b_big=4) is None  # one batch size only


# ---- the remedy ---------------------------------------------------------------------------
def answer(b_simple, **over):
    kw = {"batch": 32, "grad_accum": 2, "max_grad_accum": 8, "batch_requested": False,
          "lr_lowered": False, "cfg": CFG, **over}
    return remedy(b_simple=b_simple, **kw)


def test_a_noise_scale_well_above_the_batch_raises_the_accumulation_within_its_bound():
    assert answer(70.0, max_grad_accum=16).grad_accum == 2 * 3  # ceil(70 / 32) = 3x
    assert answer(1000.0).grad_accum == 8  # capped at max_grad_accum
    assert answer(math.inf).action == "raise_batch"
    assert "noise scale 100" in answer(100.0).why


def test_a_noise_scale_near_the_batch_or_unmeasured_or_a_batch_at_its_bound_lowers_the_lr():
    assert answer(60.0).action == "lower_lr"  # under 2 x 32
    assert answer(None).action == "lower_lr" and "not measured" in answer(None).why
    assert answer(1000.0, grad_accum=8).action == "lower_lr"
    assert answer(1000.0, batch_requested=True).action == "lower_lr"


def test_shaking_again_under_a_lowered_lr_takes_the_data_path():
    assert answer(None, lr_lowered=True).action == "data"
    assert answer(60.0, lr_lowered=True).action == "data"
    assert answer(1000.0, lr_lowered=True).action == "raise_batch"  # noise is still noise
    assert answer(None, lr_lowered=True, data_tried=True).action == "none"  # once
