"""`ops.profile_every`: how many steps apart the trainer profiles one step for the
compute/communication overlap series; 0 (off) by default, and added without changing the
hash of any spec that does not set it."""

from __future__ import annotations

import pytest

from common.errors import BadConfig
from spec import OpsConfig, RunSpec
from tests.spec.helpers import pinned


def test_profiling_is_off_by_default_and_the_default_leaves_spec_hashes_alone():
    assert OpsConfig().profile_every == 0
    # the demo preset's hash before the multi-node fields (tests/spec/test_spec.py pins the same)
    assert pinned().spec_hash() == "c8357bb19b1b4caf"
    assert pinned(**{"ops.profile_every": 100}).spec_hash() != "c8357bb19b1b4caf"


@pytest.mark.parametrize("value", [-1, 2.5, True, "100", 10**10])
def test_a_profile_interval_that_is_not_a_whole_number_of_steps_names_the_field(value):
    with pytest.raises(BadConfig) as err:
        RunSpec.from_dict({"run_id": "r", "ops": {"profile_every": value}})
    assert err.value.field == "ops.profile_every"


def test_a_negative_interval_built_in_code_is_refused_with_the_fix():
    with pytest.raises(BadConfig) as err:
        OpsConfig(profile_every=-5)
    assert err.value.field == "profile_every" and "0 to leave profiling off" in err.value.fix
