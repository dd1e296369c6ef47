"""RunCarry across continue-as-new (workflows/carry.py) and the pure carry updates
(workflows/carry_updates.py), with literal carries and the ones recorded histories hold."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import pytest

from activities.contracts import TrainSegmentResult
from common.commands import Rollback
from common.protocol import OperatorRollback
from workflows.carry import LEGACY_CARRY_KEYS, WIRE_KEYS, Escalation, Hold, OperatorQueue, RunCarry
from workflows.carry_updates import apply_rollback, record_segment, status_view

HISTORIES = Path(__file__).parent / "histories"

PENDING = {"id": "run/op1", "to_step": 5, "through_step": 7, "skip_data": True,
           "note": "bad shard", "who": "carol"}


def test_a_carry_crosses_continue_as_new_as_json_and_reads_back_equal():
    carry = RunCarry(next_step=5, stages_done=["prepare_data", "warmup_sweep"],
                     operator=OperatorQueue(
                         pending_rollback=OperatorRollback(**PENDING), rollback_pins=["pin-a"],
                         queue=[{"id": "op2", "name": "pause", "raw": None,
                                 "accepted_at_step": 5}], actions=2),
                     hold=Hold(held={"stage": "paused", "reason": "look", "who": ""}))
    wire = json.loads(json.dumps(carry.to_json()))  # what Temporal carries
    assert RunCarry.from_json(wire) == carry
    assert RunCarry.from_json(None) == RunCarry()  # the chain's first run


def test_the_wire_shape_is_the_flat_object_of_before_the_records():
    """One flat object with every key the carry had before its records: a carry written
    here reads on a worker still running the older code (a rolling deploy)."""
    wire = RunCarry(escalation=Escalation(rollback_steps=[3]), hold=Hold(pauses=1)).to_json()
    assert sorted(wire) == sorted(WIRE_KEYS)
    assert (wire["rollback_steps"], wire["pauses"], wire["operator_queue"]) == ([3], 1, [])
    assert all(not dataclasses.is_dataclass(v) for v in wire.values())


def recorded_carries() -> list[tuple[str, dict]]:
    """The carries continued runs of the recorded histories started with (flat objects
    written by the code each directory names)."""
    out = []
    for path in sorted(HISTORIES.glob("*/*.json")):
        first = json.loads(path.read_text())["events"][0]
        started = first["workflowExecutionStartedEventAttributes"]
        payloads = started.get("input", {}).get("payloads", [])
        if len(payloads) > 1 and (carry := json.loads(base64.b64decode(payloads[1]["data"]))):
            out.append((f"{path.parent.name}/{path.name}", carry))
    return out


@pytest.mark.parametrize("name,old", recorded_carries())
def test_a_flat_carry_older_code_wrote_decodes_to_the_same_values(name, old):
    carry = RunCarry.from_json(old)
    renamed = {LEGACY_CARRY_KEYS.get(k, k): v for k, v in old.items()}
    again = carry.to_json()
    assert {k: again[k] for k in renamed} == renamed, name
    if len(old) == len(WIRE_KEYS):  # written by the code just before the records: the same
        assert again == old  # (Temporal's JSON converter writes the keys sorted)
    assert carry.next_step == old["next_step"] and carry.hold.held == old["held"]
    assert carry.escalation.rollback_steps == old["rollback_steps"]
    assert carry.operator.queue == old["operator_queue"]


def test_a_carry_written_before_the_rename_keeps_its_pending_rollback_and_pins():
    """Runs continued as new by the code before the rename carry `rewind` / `rewind_pins`;
    dropping them would lose the rollback and leak its pin (test_replay.py's rollback.1)."""
    old = {"next_step": 5, "rewind": PENDING, "rewind_pins": ["pin-a"], "runs": 2,
           "a_key_from_newer_code": 1}
    carry = RunCarry.from_json(old)
    assert carry.operator.pending_rollback == OperatorRollback(**PENDING)
    assert (carry.operator.rollback_pins, carry.next_step, carry.runs) == (["pin-a"], 5, 2)
    assert "rewind" not in carry.to_json()  # the next carry has the new names only


def test_rollbacks_applied_before_a_segment_skip_through_the_furthest_step_reached():
    carry = RunCarry(next_step=90)
    apply_rollback(carry, Rollback(to_step=50, who="a"), "r/op1", "pin-1")
    apply_rollback(carry, Rollback(to_step=30, skip_data=False), "r/op2", "")
    assert carry.next_step == 30 and carry.operator.rollback_pins == ["pin-1"]
    assert carry.operator.pending_rollback == OperatorRollback(
        id="r/op2", to_step=30, through_step=90, skip_data=False)
    status = status_view(None, carry, stage="paused", evals={}, running=None)
    assert status["pending_rollback"]["through_step"] == 90  # JSON for `run status`


def test_a_returned_segment_moves_the_run_and_counts_its_rollbacks():
    carry = RunCarry(next_step=10, escalation=Escalation(rollback_steps=[4], rollbacks_total=1))
    seg = TrainSegmentResult(final_step=20, last_committed_step=20, last_committed_uri="u",
                             train_loss=2.5, resumed_from=10, attempt=1,
                             rollbacks=[{"at_step": 14}, {"at_step": 17}],
                             stopped="overfitting", oldest_committed_step=10)
    record_segment(carry, seg)
    assert (carry.next_step, carry.train_loss, carry.segments_total) == (20, 2.5, 1)
    assert (carry.escalation.rollback_steps, carry.escalation.rollbacks_total) == ([4, 14, 17], 3)
    assert (carry.oldest_step, carry.early_stopped) == (10, "overfitting")


def test_the_after_fault_is_the_fault_record_in_code_and_its_json_object_on_the_wire():
    from common.faults import Fault

    fault = Fault("oom", "CUDA out of memory", event_id="fault/0-10/x/1", fault_ts=5.0,
                  detected_ts=5.5, last_step=3, also=("fault/h0",))
    wire = RunCarry(after_fault=fault).to_json()["after_fault"]
    # what older code reads of it is there, under the keys it always had
    assert {k: wire[k] for k in ("event_id", "fault_ts", "detected_ts", "last_step", "also")} \
        == {"event_id": "fault/0-10/x/1", "fault_ts": 5.0, "detected_ts": 5.5, "last_step": 3,
            "also": ["fault/h0"]}
    assert RunCarry.from_json({"after_fault": wire}).after_fault == fault
    older = {"event_id": "fault/0-10/x/1", "fault_ts": 5.0, "detected_ts": 5.0, "last_step": 3}
    assert RunCarry.from_json({"after_fault": older}).after_fault == Fault(
        "", event_id="fault/0-10/x/1", fault_ts=5.0, detected_ts=5.0, last_step=3)
