"""A loss that shakes rather than spikes: pure detection, the gradient noise scale, and the
answer. Applied to the live run by trainer/oscillation_watch.py.

Detection (`observe`): the accepted losses of a segment, after `warmup`, fall into blocks
of `window`. Each block's spread is measured around its own robust trend (a Theil-Sen line:
the median of the pairwise slopes, Sen 1968), as (1.4826 x MAD of the residuals)^2, so a
steadily falling loss has none and one outlier in a block moves nothing: more than half of
a block's residuals must grow before its figure does. A block whose variance is `ratio`
times the median of the earlier blocks' (floored at (`min_spread` x the loss level)^2, so a
flat, perfectly clean history cannot make any wobble infinite) is an oscillation; it does
not join the reference, as a spike never joins the spike detector's baseline. Single
outliers are the spike detector's (trainer/spikes.py); its outliers never reach here.

Measurement (`noise_scale`): McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", appendix A.1. With |G_b|^2 the squared norm of a gradient averaged over b
examples, E|G_b|^2 = |G|^2 + tr(S)/b, so two batch sizes give unbiased estimates

    |G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(S) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

and the simple noise scale B_simple = tr(S) / |G|^2: the batch above which a larger batch
stops buying a proportionally better step. The ratio is taken of the averaged estimates (the
paper averages numerator and denominator separately: each sample alone is noisy).

The answer (`remedy`): the noise scale well above the batch: a larger batch (more gradient
accumulation, the data order kept); else the learning rate, lowered for a span; shaking
again under a lowered LR: the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from statistics import median

from spec.spikes import OscillationConfig
from trainer.spikes import MAD_TO_SIGMA

MAX_REFERENCES = 16  # earlier blocks kept for the reference variance (their median)


@dataclass(frozen=True, kw_only=True)
class OscillationState:
    block: tuple[float, ...] = ()  # accepted losses of the block being filled
    start: int = 0  # the step of the block's first loss
    references: tuple[float, ...] = ()  # robust residual variances of earlier calm blocks
    seen: int = 0  # accepted losses observed


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One full block, judged."""

    start: int  # its first step
    step: int  # its last step
    variance: float  # robust residual variance around its trend
    reference: float  # what it is compared with (median of earlier blocks, floored)
    ratio: float  # variance / reference
    level: float  # median loss of the block
    oscillating: bool


@dataclass(frozen=True, kw_only=True)
class NoiseScale:
    """The simple gradient noise scale, in the units of the batch sizes given (sequences)."""

    gradient_sq: float  # |G|^2 estimate
    trace: float  # tr(Sigma) estimate
    b_simple: float  # tr / |G|^2; inf where the |G|^2 estimate is <= 0 (noise dominates)


@dataclass(frozen=True, kw_only=True)
class Remedy:
    action: str  # raise_batch | lower_lr | data | none
    why: str
    grad_accum: int | None = None  # raise_batch: the accumulation asked for


def theil_sen(values: tuple[float, ...] | list[float]) -> tuple[float, float]:
    """(intercept, slope) of the Theil-Sen line through (i, values[i]): the median of the
    pairwise slopes, then the median intercept. Robust to a minority of outliers."""
    n = len(values)
    slope = median((values[j] - values[i]) / (j - i) for i in range(n) for j in range(i + 1, n))
    return median(v - slope * i for i, v in enumerate(values)), slope


def residual_variance(values: tuple[float, ...] | list[float]) -> float:
    """(1.4826 x MAD)^2 of the residuals around the Theil-Sen trend: a variance that a
    trend does not inflate and fewer than half the points cannot."""
    a, b = theil_sen(values)
    residuals = [v - (a + b * i) for i, v in enumerate(values)]
    mid = median(residuals)
    return (MAD_TO_SIGMA * median(abs(r - mid) for r in residuals)) ** 2


def judge_block(block: tuple[float, ...], references: tuple[float, ...], start: int,
                step: int, cfg: OscillationConfig) -> Reading:
    variance, level = residual_variance(block), median(block)
    floor = (cfg.min_spread * max(abs(level), 1.0)) ** 2
    reference = max(median(references), floor)
    ratio = variance / reference
    return Reading(start=start, step=step, variance=variance, reference=reference, ratio=ratio,
                   level=level, oscillating=ratio >= cfg.ratio)


def observe(state: OscillationState, step: int, loss: float,
            cfg: OscillationConfig) -> tuple[OscillationState, Reading | None]:
    """Take one accepted loss; a Reading when it completes a block that can be judged
    (`references` earlier blocks exist), else None."""
    seen = state.seen + 1
    if seen <= cfg.warmup:
        return replace(state, seen=seen), None
    start = state.start if state.block else step
    block = state.block + (loss,)
    if len(block) < cfg.window:
        return replace(state, seen=seen, block=block, start=start), None
    reading = None
    if len(state.references) >= cfg.references:
        reading = judge_block(block, state.references, start, step, cfg)
    references = state.references
    if reading is None or not reading.oscillating:  # a shaking block is no reference
        references = (references + (residual_variance(block),))[-MAX_REFERENCES:]
    return OscillationState(references=references, seen=seen), reading


def restart_block(state: OscillationState) -> OscillationState:
    """After a decision or a rollback: the next block starts afresh (its losses all come
    after it); the references stay."""
    return replace(state, block=(), start=0)


def noise_scale(small_sq: float, big_sq: float, b_small: float, b_big: float
                ) -> NoiseScale | None:
    """B_simple from the mean squared gradient norms at two batch sizes (McCandlish et al.
    2018, A.1); None where b_big <= b_small or the noise estimate is not positive (no
    noise to speak of: the batch is not what shakes the loss)."""
    if b_big <= b_small:
        return None
    gradient_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    if trace <= 0:
        return None
    b_simple = trace / gradient_sq if gradient_sq > 0 else math.inf
    return NoiseScale(gradient_sq=gradient_sq, trace=trace, b_simple=b_simple)


def remedy(*, b_simple: float | None, batch: int, grad_accum: int, max_grad_accum: int,
           batch_requested: bool, lr_lowered: bool, cfg: OscillationConfig,
           data_tried: bool = False) -> Remedy:
    """What to do about an oscillation. `batch` is the global batch in sequences, the unit
    of `b_simple`; `max_grad_accum`: the run's one bound on a raised accumulation
    (spec/spikes.py batch_bound), at which a larger batch is not asked for but the next
    answer taken, as the workflow would grant no more; `lr_lowered`: the step is inside an
    LR window an earlier oscillation set (it shakes at the lowered LR too); `data_tried`:
    the data path was taken under that window already (once: a rollback goes back before
    the block, and a shaking that skipping its data does not end would otherwise roll back
    forever)."""
    noisy = b_simple is not None and b_simple > cfg.batch_margin * batch
    if b_simple is not None and noisy and not batch_requested:
        want = min(max_grad_accum, grad_accum * math.ceil(min(b_simple, 1e12) / batch))
        if want > grad_accum:
            return Remedy(action="raise_batch", grad_accum=want,
                          why=f"gradient noise scale {b_simple:.4g} sequences is over "
                              f"{cfg.batch_margin:g}x the global batch of {batch}: the "
                              f"gradient estimate is noisy")
    if not lr_lowered:
        measured = ("the gradient noise scale was not measured" if b_simple is None
                    else f"the gradient noise scale {b_simple:.4g} sequences does not call "
                         f"for a larger batch than {batch}" if not noisy
                    else "a larger batch is asked for already" if batch_requested
                    else f"the gradient accumulation {grad_accum} is at its bound of "
                         f"{max_grad_accum} (spikes.oscillation.max_batch_factor x the "
                         f"spec's train.grad_accum)")
        return Remedy(action="lower_lr", why=f"{measured}: the step size is the suspect")
    if data_tried:
        return Remedy(action="none", why="it shakes on after a lower LR and a rollback past "
                                         "its data: left to a person")
    return Remedy(action="data", why="the loss shakes at the LR an earlier oscillation "
                                     "lowered: the data is the suspect")
