"""RunCarry across continue-as-new (activities/contracts.py) and the pure carry updates
(workflows/carry.py), with literal carries."""

from __future__ import annotations

import dataclasses
import json

from activities.contracts import OperatorRollback, Rollback, RunCarry, TrainSegmentResult
from workflows.carry import apply_rollback, record_segment, status_view

PENDING = {"id": "run/op1", "to_step": 5, "through_step": 7, "skip_data": True,
           "note": "bad shard", "who": "carol"}


def test_a_carry_crosses_continue_as_new_as_json_and_reads_back_equal():
    carry = RunCarry(next_step=5, stages_done=["prepare_data", "warmup_sweep"],
                     pending_rollback=OperatorRollback(**PENDING), rollback_pins=["pin-a"],
                     operator_queue=[{"id": "op2", "name": "pause", "raw": None,
                                      "accepted_at_step": 5}],
                     held={"stage": "paused", "reason": "look", "who": ""})
    wire = json.loads(json.dumps(dataclasses.asdict(carry)))  # what Temporal carries
    assert RunCarry.from_json(wire) == carry
    assert RunCarry.from_json(None) == RunCarry()  # the chain's first run


def test_a_carry_written_before_the_rename_keeps_its_pending_rollback_and_pins():
    """Runs continued as new by the code before the rename carry `rewind` / `rewind_pins`;
    dropping them would lose the rollback and leak its pin (test_replay.py's rollback.1)."""
    old = {"next_step": 5, "rewind": PENDING, "rewind_pins": ["pin-a"], "runs": 2,
           "a_key_from_newer_code": 1}
    carry = RunCarry.from_json(old)
    assert carry.pending_rollback == OperatorRollback(**PENDING)
    assert (carry.rollback_pins, carry.next_step, carry.runs) == (["pin-a"], 5, 2)
    assert "rewind" not in dataclasses.asdict(carry)  # the next carry has the new names only


def test_rollbacks_applied_before_a_segment_skip_through_the_furthest_step_reached():
    carry = RunCarry(next_step=90)
    apply_rollback(carry, Rollback(to_step=50, who="a"), "r/op1", "pin-1")
    apply_rollback(carry, Rollback(to_step=30, skip_data=False), "r/op2", "")
    assert carry.next_step == 30 and carry.rollback_pins == ["pin-1"]
    assert carry.pending_rollback == OperatorRollback(id="r/op2", to_step=30, through_step=90,
                                                      skip_data=False)
    status = status_view(None, carry, stage="paused", evals={}, running=None)
    assert status["pending_rollback"]["through_step"] == 90  # JSON for `run status`


def test_a_returned_segment_moves_the_run_and_counts_its_rollbacks():
    carry = RunCarry(next_step=10, rollback_steps=[4], rollbacks_total=1, oldest_step=0)
    seg = TrainSegmentResult(final_step=20, last_committed_step=20, last_committed_uri="u",
                             train_loss=2.5, resumed_from=10, attempt=1,
                             rollbacks=[{"at_step": 14}, {"at_step": 17}],
                             stopped="overfitting", oldest_committed_step=10)
    record_segment(carry, seg)
    assert (carry.next_step, carry.train_loss, carry.segments_total) == (20, 2.5, 1)
    assert (carry.rollback_steps, carry.rollbacks_total) == ([4, 14, 17], 3)
    assert (carry.oldest_step, carry.early_stopped) == (10, "overfitting")
