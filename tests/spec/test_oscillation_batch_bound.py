"""The oscillation's batch raise has one bound, checked when the spec is read: the spec's own
train.grad_accum x spikes.oscillation.max_batch_factor may not pass train.grad_accum's own
limit, or the first raise to it would be refused as a bad spec hours into the run."""

from __future__ import annotations

import time

import pytest

from common.errors import BadConfig
from spec import RunSpec
from spec.spikes import MAX_GRAD_ACCUM, batch_bound
from tests.spec.helpers import demo, refused

ON = {"spikes.oscillation.enabled": True, "sweep.enabled": False}


def test_grad_accums_limit_is_the_train_fields_own():
    assert MAX_GRAD_ACCUM == 1 << 16  # spec/train.py declares grad_accum in [1, 2^16]
    with pytest.raises(BadConfig):
        RunSpec.from_dict(demo(**{"train.grad_accum": MAX_GRAD_ACCUM + 1, "sweep.enabled": False}))


def test_a_factor_whose_raise_passes_grad_accums_limit_is_refused_naming_the_factor():
    began = time.monotonic()
    err = refused(demo(**ON, **{"train.grad_accum": 1 << 15,
                                "spikes.oscillation.max_batch_factor": 4}))
    assert time.monotonic() - began < 1.0
    assert err.field == "spikes.oscillation.max_batch_factor"
    assert "131072" in err.problem and "65536" in err.problem  # the raise and the limit
    assert "2" in err.fix  # the largest factor that fits: 2^16 / 2^15


def test_the_factor_that_reaches_grad_accums_limit_exactly_is_accepted_and_its_raise_valid():
    spec = RunSpec.from_dict(demo(**ON, **{"train.grad_accum": 1 << 14,
                                           "spikes.oscillation.max_batch_factor": 4}))
    bound = batch_bound(spec.train.grad_accum, spec.spikes.oscillation)
    assert bound == MAX_GRAD_ACCUM
    # what the workflow builds for the segments after a raise to the bound (carry_updates.py
    # segment_spec): the raised accumulation, and the run's bound beside it
    raised = spec.replace(**{"train.grad_accum": bound,
                             "spikes.oscillation.max_grad_accum": bound})
    assert raised.train.grad_accum == bound
    assert batch_bound(raised.train.grad_accum, raised.spikes.oscillation) == bound


def test_a_bound_set_below_grad_accum_is_refused_naming_it():
    err = refused(demo(**ON, **{"train.grad_accum": 8, "spikes.oscillation.max_grad_accum": 4}))
    assert err.field == "spikes.oscillation.max_grad_accum" and "below" in err.problem


def test_the_bound_field_left_at_zero_keeps_every_hash_set_or_not():
    # spec_hash leaves a field added inside an added section out at its default
    # (spec/run.py added_within): a run that turned the oscillation on keeps its hash
    from spec.run import without_added
    on = RunSpec.from_dict(demo(**ON))
    d = on.to_dict()["spikes"]
    assert d["oscillation"]["max_grad_accum"] == 0
    assert "max_grad_accum" not in without_added(type(on.spikes), d)["oscillation"]
    assert on.replace(**{"spikes.oscillation.max_grad_accum": 4}).spec_hash() != on.spec_hash()


def test_a_factor_past_the_limit_is_left_alone_while_the_oscillation_cannot_raise_anything():
    # off (its default), or spike handling off: no raise is ever asked, so no bound applies
    for off in ({"spikes.oscillation.enabled": False},
                {"spikes.oscillation.enabled": True, "spikes.enabled": False}):
        spec = RunSpec.from_dict(demo(**{**off, "sweep.enabled": False,
                                         "train.grad_accum": MAX_GRAD_ACCUM,
                                         "spikes.oscillation.max_batch_factor": 1024}))
        assert spec.train.grad_accum == MAX_GRAD_ACCUM


def test_the_bound_is_the_spec_grad_accum_times_the_factor():
    spec = RunSpec.from_dict(demo(**ON, **{"train.grad_accum": 3,
                                           "spikes.oscillation.max_batch_factor": 5}))
    assert batch_bound(spec.train.grad_accum, spec.spikes.oscillation) == 15
