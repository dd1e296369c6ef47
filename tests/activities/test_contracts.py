"""The Temporal boundary's dataclasses decode what older code wrote."""

from __future__ import annotations

import asyncio

from temporalio.converter import DataConverter

from activities.contracts import TrainSegmentInput
from common.protocol import OperatorRollback


def _roundtrip(value: object, tp: type) -> object:
    async def go():
        conv = DataConverter.default
        (out,) = await conv.decode(await conv.encode([value]), [tp])
        return out
    return asyncio.run(go())


def test_a_segment_scheduled_with_the_old_rewind_key_still_applies_its_rollback():
    old = {"spec": {}, "dataset_uri": "d", "from_step": 0, "to_step": 5,
           "rewind": {"id": "r/op1", "to_step": 2, "through_step": 9, "skip_data": True,
                      "note": "bad shard", "who": "alice"}}
    inp = _roundtrip(old, TrainSegmentInput)
    assert inp.rollback == OperatorRollback(id="r/op1", to_step=2, through_step=9,
                                            skip_data=True, note="bad shard", who="alice")
    assert inp.rewind is None


def test_a_segment_input_round_trips_its_typed_rollback():
    rb = OperatorRollback(id="r/op2", to_step=4, through_step=8)
    inp = _roundtrip(TrainSegmentInput(spec={}, dataset_uri="d", from_step=0, to_step=5,
                                       rollback=rb), TrainSegmentInput)
    assert inp.rollback == rb and inp.rewind is None
