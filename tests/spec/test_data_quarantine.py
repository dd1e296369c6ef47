"""`data.quarantine`: a list of quarantine files, checked when the spec is read, each error
naming the entry and the fix; absent, it leaves every existing spec's hash alone."""

from __future__ import annotations

import pytest

from common.errors import BadConfig
from spec import RunSpec
from spec.paths import anchor
from tests.spec.helpers import pinned


def _spec(quarantine) -> RunSpec:
    return RunSpec.from_dict({"run_id": "r", "data": {"quarantine": quarantine}})


@pytest.mark.parametrize("quarantine, field, words", [
    ([""], "data.quarantine[0]", "is empty"),
    (["  "], "data.quarantine[0]", "is empty"),
    (["runs/a/quarantine.json"], "data.quarantine[0]", "is not a .jsonl file"),
    (["runs/a/quarantine.jsonl", "runs/*/quarantine.jsonl"], "data.quarantine[1]", "is a glob"),
    (["a.jsonl", "b.jsonl", "a.jsonl"], "data.quarantine[2]", "is listed twice"),
    (["s3://user:pw@bucket/q.jsonl"], "data.quarantine[0]", "carries credentials"),
    (["nosuch://bucket/q.jsonl"], "data.quarantine[0]", ""),
    ("runs/a/quarantine.jsonl", "data.quarantine", "expected a list"),
    ([7], "data.quarantine[0]", "expected str"),
])
def test_a_bad_quarantine_entry_is_bad_config_naming_it_and_the_fix(quarantine, field, words):
    with pytest.raises(BadConfig) as err:
        _spec(quarantine)
    assert err.value.field == field and words in str(err.value) and err.value.fix
    assert "pw" not in str(err.value)


def test_quarantine_files_round_trip_and_change_the_hash_only_when_given():
    plain = RunSpec.from_dict({"run_id": "r"})
    given = _spec(["/q/runs/a/quarantine.jsonl", "s3://bucket/store/runs/b/quarantine.jsonl"])
    assert given.data.quarantine == ("/q/runs/a/quarantine.jsonl",
                                     "s3://bucket/store/runs/b/quarantine.jsonl")
    assert RunSpec.from_dict(given.to_dict()) == given
    assert given.spec_hash() != plain.spec_hash()
    assert _spec([]).spec_hash() == plain.spec_hash()
    # measured before data.quarantine existed (tests/spec/test_auto_checkpoint.py): a run's
    # claim and its checkpoints' config_hash stay valid
    assert pinned().spec_hash() == "c8357bb19b1b4caf"


def test_a_relative_quarantine_file_is_anchored_like_the_corpus():
    spec = _spec(["runs/a/quarantine.jsonl", "s3://bucket/runs/b/quarantine.jsonl"])
    assert anchor(spec, "/work").data.quarantine == ("/work/runs/a/quarantine.jsonl",
                                                      "s3://bucket/runs/b/quarantine.jsonl")
