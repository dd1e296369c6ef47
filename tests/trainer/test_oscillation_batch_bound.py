"""The oscillation's batch raise against its one bound (spec/spikes.py batch_bound): a segment
whose accumulation the workflow already raised bounds its asks by the spec's own
accumulation, held in its spec, so at the bound it asks for no raise the workflow would
refuse (a segment stopped early for nothing, again and again) but lowers the LR."""

from __future__ import annotations

import math
from types import SimpleNamespace

from common.protocol import SegmentOutcome
from spec import RunSpec
from spec.spikes import OscillationConfig
from tests.spec.helpers import demo
from trainer.oscillation import Reading, remedy
from trainer.oscillation_watch import OscillationWatch
from trainer.spikes import Verdict
from workflows.carry import RunCarry
from workflows.carry_updates import segment_spec

CFG = OscillationConfig(enabled=True, max_batch_factor=4)


def test_at_the_bound_the_remedy_lowers_the_lr_and_says_the_batch_is_at_its_bound():
    found = remedy(b_simple=1e6, batch=32, grad_accum=8, max_grad_accum=8,
                   batch_requested=False, lr_lowered=False, cfg=CFG)
    assert found.action == "lower_lr" and found.grad_accum is None
    assert "at its bound of 8" in found.why and "max_batch_factor" in found.why


def test_past_the_bound_the_remedy_never_asks_and_below_it_asks_at_most_the_bound():
    # an accumulation above the bound (an elastic segment's, on fewer nodes) asks for none
    assert remedy(b_simple=1e6, batch=32, grad_accum=16, max_grad_accum=8,
                  batch_requested=False, lr_lowered=False, cfg=CFG).action == "lower_lr"
    below = remedy(b_simple=math.inf, batch=32, grad_accum=2, max_grad_accum=8,
                   batch_requested=False, lr_lowered=False, cfg=CFG)
    assert (below.action, below.grad_accum) == ("raise_batch", 8)


def watch_for(spec: RunSpec) -> tuple[OscillationWatch, SegmentOutcome, list]:
    """The watch as a one-rank segment of `spec` builds it (noise_every 0: no engine read)."""
    emitted: list = []
    outcome = SegmentOutcome()
    ctx = SimpleNamespace(spec=spec, world=1)
    watch = OscillationWatch(ctx, None, outcome, lambda kind, *a, **kw: emitted.append(kw))
    # the gradient noise scale stands far above any batch: a larger one is what it calls for
    watch.samples = [(20.0, 2.0)]  # |G|^2 estimate <= 0: B_simple infinite
    watch.why_unmeasured = ""
    return watch, outcome, emitted


def shaking(step: int) -> Reading:
    return Reading(start=step - 15, step=step, variance=1.0, reference=0.01, ratio=100.0,
                   level=3.0, oscillating=True)


def run_spec(**over) -> RunSpec:
    return RunSpec.from_dict(demo(**{"spikes.oscillation.enabled": True,
                                     "spikes.oscillation.noise_every": 0,
                                     "spikes.oscillation.max_batch_factor": 4,
                                     "train.grad_accum": 2, "sweep.enabled": False, **over}))


def test_a_segment_raised_to_the_bound_lowers_the_lr_instead_of_asking_for_more():
    # the workflow raised 2 -> 8 = 2 x max_batch_factor: the run's bound
    spec = segment_spec(run_spec(), RunCarry(grad_accum=8))
    assert spec.train.grad_accum == 8
    watch, outcome, emitted = watch_for(spec)
    assert watch.max_accum == 8  # the spec's own 2 x 4, not the raised 8 x 4
    verdict = watch.answer(shaking(40), Verdict(action="ok", step=40, loss=3.0))
    assert verdict.action == "ok"
    assert outcome.grad_accum_asked is None  # the segment does not stop to ask
    (record,) = emitted
    assert record["action"] == "lower_lr" and record["lr_window"] == [40, 240, 0.5]
    assert record["grad_accum_bound"] == 8 and "at its bound" in record["why"]


def test_a_segment_raised_below_the_bound_asks_for_no_more_than_the_bound():
    spec = segment_spec(run_spec(), RunCarry(grad_accum=4))
    watch, outcome, emitted = watch_for(spec)
    watch.answer(shaking(40), Verdict(action="ok", step=40, loss=3.0))
    assert emitted[0]["action"] == "raise_batch" and outcome.grad_accum_asked == 8


def test_an_unraised_segment_bounds_by_its_own_accumulation():
    watch, outcome, _ = watch_for(run_spec())
    watch.answer(shaking(40), Verdict(action="ok", step=40, loss=3.0))
    assert watch.max_accum == 8 and outcome.grad_accum_asked == 8
