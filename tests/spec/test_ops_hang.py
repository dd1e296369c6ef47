"""The hang-detection fields of `ops`: "auto" or seconds, each number in a
documented range, a bad value refused naming the field and the fix."""

from __future__ import annotations

import json

import pytest

from spec import RunSpec
from tests.spec.helpers import demo as _demo
from tests.spec.helpers import refused as _error


def test_hang_and_startup_timeouts_are_auto_by_default_and_round_trip_through_json():
    spec = RunSpec.from_dict(_demo())
    assert (spec.ops.hang_timeout_s, spec.ops.startup_timeout_s) == ("auto", "auto")
    assert (spec.ops.hang_floor_s, spec.ops.hang_step_factor) == (60.0, 10.0)
    assert (spec.ops.startup_floor_s, spec.ops.checkpoint_mb_per_s) == (600.0, 50.0)
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.spec_hash() == spec.spec_hash()


@pytest.mark.parametrize("field", ["ops.hang_timeout_s", "ops.startup_timeout_s"])
@pytest.mark.parametrize("value", [10, 10.0, 1, 7 * 86400.0])  # 1 s: the minimum
def test_a_number_of_seconds_is_kept_as_a_fixed_timeout(field, value):
    spec = RunSpec.from_dict(_demo(**{field: value}))
    got = getattr(spec.ops, field.split(".")[1])
    assert got == float(value) and isinstance(got, float)
    assert spec.spec_hash() != RunSpec.from_dict(_demo()).spec_hash()


@pytest.mark.parametrize("field", ["ops.hang_timeout_s", "ops.startup_timeout_s"])
@pytest.mark.parametrize("value, says", [
    ("fast", "'auto'"), ("AUTO", "'auto'"), ("", "'auto'"), (0, "positive"), (-1, "between"),
    (1e9, "between"), (True, "a number"), (None, "a number"), ([60], "a number")])
def test_a_bad_timeout_is_refused_naming_the_field_and_the_fix(field, value, says):
    err = _error(_demo(**{field: value}))
    assert err.field == field and says in f"{err.problem} {err.fix}", (err.problem, err.fix)


def test_an_infinite_timeout_from_json_text_is_refused():
    raw = json.loads('{"run_id": "r", "ops": {"startup_timeout_s": Infinity}}')
    err = _error(raw)
    assert err.field == "ops.startup_timeout_s" and "finite" in err.problem


@pytest.mark.parametrize("field, value", [
    ("ops.hang_floor_s", 0.5), ("ops.hang_floor_s", 2 * 86400.0), ("ops.hang_step_factor", 1.0),
    ("ops.hang_step_factor", 5000.0), ("ops.startup_floor_s", 0.0),
    ("ops.checkpoint_mb_per_s", 0.0), ("ops.hang_floor_s", "auto")])
def test_the_auto_knobs_stay_in_their_ranges(field, value):
    assert _error(_demo(**{field: value})).field == field
