"""The one reader of store JSON turns every hostile record into StoreRecordInvalid (a
ValueError the readers already handle), never RecursionError, OverflowError or a hang."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.store_json import (
    MAX_DEPTH,
    StoreRecordInvalid,
    field_float,
    field_int,
    field_str,
    load_line,
    load_record,
)


@pytest.mark.parametrize("raw, problem", [
    ("[" * 100_000 + "]" * 100_000, "nested"),
    ('{"a": Infinity}', "finite"),
    ('{"a": -Infinity}', "finite"),
    ('{"a": NaN}', "finite"),
    ('{"a": 1e999}', "finite"),
    ('{"a": 1' + "0" * 5000 + "}", "digits"),
    ('"a string"', "not an object"),
    ("{", "not JSON"),
    (b'{"a": "\xff"}', "UTF-8"),
])
def test_hostile_record_is_refused_as_invalid_naming_the_problem(raw, problem):
    with pytest.raises(StoreRecordInvalid, match=problem) as caught:
        load_record(raw, "runs/r/lineage/1.json")
    assert isinstance(caught.value, ValueError)
    assert caught.value.what == "runs/r/lineage/1.json"


def test_nesting_past_the_bound_is_refused_and_at_the_bound_is_read():
    def nested(depth: int) -> str:
        return '{"a": ' * (depth - 1) + '{"a": 1' + "}" * depth

    assert load_record(nested(MAX_DEPTH), "r")
    with pytest.raises(StoreRecordInvalid, match="deeper"):
        load_record(nested(MAX_DEPTH + 1), "r")


def test_oversized_record_is_refused_before_it_is_decoded():
    raw = b'{"a": "' + b"x" * 200 + b'"}'
    with pytest.raises(StoreRecordInvalid, match="bytes"):
        load_line(raw, "events/w-1.jsonl:1", max_bytes=100)


def test_a_record_mainspring_writes_reads_back_unchanged():
    record = {"lineage": 3, "restored_step": 120, "abandoned": [130, 140],
              "ts": 1_733_400_000.25, "note": "rollback", "nested": {"a": [1, {"b": None}]}}
    assert load_record(json.dumps(record), "r") == record


def test_fields_are_typed_and_bounded():
    rec = {"step": 7, "big": 1e300, "text": "x" * 10, "flag": True, "whole": 12.0, "s": "7"}
    assert field_int(rec, "step", "r") == 7
    assert field_int(rec, "whole", "r") == 12
    for key in ("big", "flag", "s", "missing"):
        with pytest.raises(StoreRecordInvalid, match=f"r.{key}"):
            field_int(rec, key, "r")
    with pytest.raises(StoreRecordInvalid, match="outside"):
        field_int(rec, "step", "r", high=6)
    assert field_float(rec, "big", "r") == 1e300
    with pytest.raises(StoreRecordInvalid, match="outside"):
        field_float(rec, "big", "r", high=1e18)
    assert field_str(rec, "text", "r") == "x" * 10
    with pytest.raises(StoreRecordInvalid, match="over 5"):
        field_str(rec, "text", "r", max_len=5)
    assert field_int({}, "step", "r", default=0) == 0


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=4),
    max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(value=JSONISH)
def test_any_json_value_reads_or_is_refused_as_invalid_quickly(value):
    raw = json.dumps({"v": value})  # json.dumps writes NaN / Infinity for non-finite floats
    t0 = time.monotonic()
    try:
        got = load_record(raw, "r")
    except StoreRecordInvalid:
        return
    finally:
        assert time.monotonic() - t0 < 1.0
    for number in _numbers(got):
        assert math.isfinite(number)
        assert isinstance(number, float) or abs(number) < 10**19


def _numbers(value):
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_a_measured_nan_reads_as_null_where_the_reader_asks_for_it():
    raw = '{"loss": NaN, "hi": Infinity, "big": 1e999, "ok": 2.5}'
    with pytest.raises(StoreRecordInvalid):
        load_line(raw, "r")
    assert load_line(raw, "r", nonfinite_null=True) == {"loss": None, "hi": None, "big": None,
                                                         "ok": 2.5}
