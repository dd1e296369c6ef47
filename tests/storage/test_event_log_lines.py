"""An event line decodes in one C call where its numbers are plain (common/store_json.py),
and exactly as the per-number checks decode it everywhere: a number out of bounds anywhere
in a line, however deep, is still refused or read as null; text that merely looks like one
is text."""

from __future__ import annotations

import json

import pytest

from common.store_json import StoreRecordInvalid, load_line
from storage.events import _parse


@pytest.mark.parametrize("raw, value", [
    ('{"n": 9999999999999999999}', {"n": 10**19 - 1}),  # 19 digits: the bound
    ('{"n": -9999999999999999999}', {"n": -(10**19 - 1)}),
    ('{"x": 1.7976931348623157e308}', {"x": 1.7976931348623157e308}),  # the largest float
    ('{"x": 1e-400, "y": 0.1234567890123456789012}', {"x": 0.0, "y": 0.12345678901234568}),
    ('{"s": "NaN Infinity 1e999 99999999999999999999", "id": "3e1234abc"}',
     {"s": "NaN Infinity 1e999 99999999999999999999", "id": "3e1234abc"}),
])
def test_plain_numbers_and_number_like_text_read_as_written(raw, value):
    assert load_line(raw, "w") == value
    assert load_line(raw, "w", nonfinite_null=True) == value


@pytest.mark.parametrize("raw", [
    '{"n": 10000000000000000000}',  # 20 digits
    '{"p": {"a": [1, 2, {"b": [-10000000000000000000]}]}}',  # deep in a list in a dict
    '{"p": {"a": [1, 2, {"b": [1e999]}]}}',
    '{"p": [[[NaN]]]}', '{"p": -Infinity}', '{"p": 2e308}',
])
def test_a_number_out_of_bounds_anywhere_in_a_line_is_refused(raw):
    with pytest.raises(StoreRecordInvalid):
        load_line(raw, "w")


def test_a_measured_nan_deep_in_a_payload_reads_as_null_and_its_event_is_kept():
    line = json.dumps({"event_id": "e", "kind": "train_metrics", "ts": 1.0, "step": 3,
                       "payload": {"loss_mean": float("nan"), "w": [1.0, float("inf")]}})
    good, bad = _parse(line.encode() + b"\n" + b'{"event_id": "f", "n": 1e999}\n')
    assert bad == ['{"event_id": "f", "n": 1e999}']  # not an event: no kind, no ts
    assert [e["payload"] for e in good] == [{"loss_mean": None, "w": [1.0, None]}]
