"""RunSpec's scrub fields (storage.scrub_every, scrub_newest, scrub_mb_per_s): defaults that
leave a stored spec's hash alone, and errors that name the field and the fix."""

from __future__ import annotations

import pytest

from common.errors import BadConfig
from spec import StorageConfig
from tests.spec.helpers import pinned


def test_scrub_fields_at_their_defaults_leave_a_stored_specs_hash_alone():
    # the demo preset's hash from before the fields existed (tests/spec/test_spec.py)
    stored = pinned(run_id="hash-pin", **{"ops.hang_timeout_s": 600.0})
    assert stored.storage.scrub_every == 1 and stored.storage.scrub_newest == 2
    assert stored.spec_hash() == "110ac9f4598b1d51"
    assert stored.replace(**{"storage.scrub_every": 0}).spec_hash() != "110ac9f4598b1d51"


@pytest.mark.parametrize(("field", "value"), [("scrub_every", -1), ("scrub_newest", 0),
                                              ("scrub_mb_per_s", -1.0),
                                              ("scrub_mb_per_s", float("inf"))])
def test_a_scrub_field_out_of_range_is_refused_naming_it(field, value):
    with pytest.raises(BadConfig) as info:
        StorageConfig(**{field: value})
    assert info.value.field.endswith(field)
    with pytest.raises(BadConfig) as info:
        pinned(**{f"storage.{field}": value})
    assert info.value.field == f"storage.{field}"
