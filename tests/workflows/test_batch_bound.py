"""The workflow's side of the oscillation's batch raise (workflows/carry_updates.py): one
bound, from the spec's own accumulation, granted up to and never past, and handed to every
segment after a raise in the spec it runs, so its trainer bounds its asks the same way."""

from __future__ import annotations

import uuid

from activities.contracts import TrainSegmentResult
from spec import RunSpec
from tests.spec.helpers import demo
from tests.workflows.stub_run import Harness, scenario, spec_for
from workflows.carry import RunCarry
from workflows.carry_updates import raise_batch, run_batch_bound, segment_spec


def run_spec(**over) -> RunSpec:
    return RunSpec.from_dict(demo(**{"spikes.oscillation.enabled": True,
                                     "spikes.oscillation.max_batch_factor": 4,
                                     "train.grad_accum": 2, "sweep.enabled": False, **over}))


def asked(n: int, at: int = 30) -> TrainSegmentResult:
    return TrainSegmentResult(final_step=at, last_committed_step=at, last_committed_uri="",
                              train_loss=3.0, resumed_from=None, attempt=1,
                              stopped="raise_batch", grad_accum_asked=n)


def test_the_bound_is_the_spec_own_accumulation_times_the_factor_never_the_raised_one():
    s, c = run_spec(), RunCarry()
    assert run_batch_bound(s) == 8
    assert raise_batch(c, s, asked(4))["bound"] == 8 and c.grad_accum == 4
    raised = segment_spec(s, c)
    assert raised.train.grad_accum == 4
    assert raised.spikes.oscillation.max_grad_accum == 8  # the run's, not 4 x 4
    assert raise_batch(c, s, asked(100))["to_grad_accum"] == 8  # granted up to the bound


def test_an_ask_at_or_past_the_bound_changes_nothing_and_the_segments_keep_it():
    s, c = run_spec(), RunCarry(grad_accum=8)
    assert raise_batch(c, s, asked(32)) is None and c.grad_accum == 8
    assert segment_spec(s, c).train.grad_accum == 8
    assert segment_spec(s, c).spikes.oscillation.max_grad_accum == 8


def test_an_unraised_run_runs_its_own_spec():
    s = run_spec()
    assert segment_spec(s, RunCarry()) is s


@scenario
async def test_every_segment_after_a_raise_runs_with_the_runs_bound_in_its_spec(h: Harness):
    """The second ask goes far past the bound: granted up to it; each later segment's spec
    names the bound the spec's own accumulation sets, whatever it was raised to."""
    spec = spec_for(f"stub-bound-{uuid.uuid4().hex[:6]}", **{
        "spikes.oscillation.max_batch_factor": 4})
    h.stubs.ask_batch = {0: (3, 2), 3: (4, 100)}
    result = await (await h.start(spec)).result()
    assert result["status"] == "completed" and result["final_step"] == 20
    ran = [(s.from_step, s.spec["train"]["grad_accum"],
            s.spec["spikes"]["oscillation"]["max_grad_accum"]) for s in h.stubs.segments]
    assert ran == [(0, 1, 0), (3, 2, 4), (7, 4, 4), (17, 4, 4)]
    assert [p["bound"] for p in h.stubs.payloads("batch_raised")] == [4, 4]
