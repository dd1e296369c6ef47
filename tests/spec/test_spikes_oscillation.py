"""`spikes.oscillation`: a loss that shakes rather than spikes. Its fields are checked when
the spec is read, each error naming the field and the fix; left at their defaults they
leave every existing spec's hash alone."""

from __future__ import annotations

import dataclasses
import json

import pytest

from spec import RunSpec, SpikeConfig
from spec.codec import value_range
from spec.spikes import OscillationConfig
from tests.spec.helpers import demo as _demo
from tests.spec.helpers import refused as _error


def test_the_section_at_its_defaults_keeps_the_demo_hash_and_changes_it_when_set():
    demo = RunSpec.from_dict(_demo())
    assert demo.spec_hash() == "c8357bb19b1b4caf"  # measured before spikes.oscillation existed
    assert demo.spikes.oscillation == OscillationConfig()
    assert not OscillationConfig().enabled  # off until a clean run of the model shows none
    for field, value in [("enabled", True), ("window", 8), ("ratio", 4.0),
                         ("noise_every", 0), ("max_batch_factor", 2), ("lr_steps", 50)]:
        changed = demo.replace(**{f"spikes.oscillation.{field}": value})
        assert changed.spec_hash() != demo.spec_hash(), field


def test_the_added_defaults_are_the_fields_defaults():
    # spec_hash leaves the section out only while it equals this record (spec/run.py), the
    # fields added to the section since (OscillationConfig.ADDED) left out at their default
    fields = json.loads(json.dumps(dataclasses.asdict(OscillationConfig())))
    assert SpikeConfig.ADDED["oscillation"] == {
        k: v for k, v in fields.items() if k not in OscillationConfig.ADDED}


def test_every_numeric_field_declares_a_range_holding_its_default():
    # (tests/spec/test_spec.py checks the sections spec re-exports; this one is nested)
    numeric = [f for f in dataclasses.fields(OscillationConfig) if f.type in ("int", "float")]
    assert len(numeric) == 11
    for f in numeric:
        lo, hi = value_range(f)
        assert lo <= f.default <= hi, f.name


def test_the_section_round_trips_through_json():
    spec = RunSpec.from_dict(_demo(**{"spikes.oscillation.ratio": 4.0,
                                      "spikes.oscillation.window": 8}))
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.spikes.oscillation.ratio == 4.0


@pytest.mark.parametrize("field, value, says", [
    ("window", 3, "must be in"), ("window", 2, "must be in"), ("ratio", 1.0, "must be in (1,"),
    ("ratio", 0.5, "must be in"), ("min_spread", 0.0, "must be in (0,"),
    ("lr_factor", 1.0, "must be in (0, 1)"), ("lr_factor", 0.0, "must be in (0, 1)"),
    ("references", 0, "must be in"), ("noise_every", -1, "must be in"),
    ("max_batch_factor", 0, "must be in"), ("batch_margin", 0.5, "must be in"),
    ("nonsense", 1, "unknown field")])
def test_a_bad_field_is_refused_naming_it_and_the_fix(field, value, says):
    err = _error(_demo(**{f"spikes.oscillation.{field}": value}))
    assert err.field == f"spikes.oscillation.{field}" and says in err.problem, err
    assert err.fix
