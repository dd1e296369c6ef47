"""The one fault record (common/faults.py): one JSON shape across every boundary, the event
payload's keys kept, older shapes still read, one writer of `fault` events."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from common.faults import (
    Fault,
    detection_between,
    fault_event,
    record_fault,
    recovered_id,
    to_ms,
)
from storage.events import EventLog, read_events

HANG = Fault("hang", "no progress for 60.0s", event_id="fault/0-40/ex/1", detected_by="supervisor",
             fault_ts=100.0, detected_ts=160.25, attempt=1, segment="0-40", last_step=12,
             rank=0, log_tail=("step 12",), fingerprint="hang at step 12", repeats=1,
             facts={"timeout": "hang_timeout_s", "timeout_s": 60.0})

# the keys the supervisor's fault events always had (ops/report.py, ops/goodput.py read them)
PAYLOAD_KEYS = {"kind", "injected", "evidence", "exit_code", "signal", "rank", "error_type",
                "frame", "log_tail", "fault_ts", "detected_ts", "detection_s", "attempt",
                "last_step", "segment", "detected_by", "fingerprint", "repeats"}


def test_a_fault_crosses_json_unchanged():
    wire = json.loads(json.dumps(HANG.to_json()))
    assert Fault.from_json(wire) == HANG


def test_the_event_payload_keeps_every_key_readers_know_and_the_kinds_facts_beside_them():
    payload = HANG.to_json()
    assert PAYLOAD_KEYS <= set(payload)
    assert payload["detection_s"] == 60.25 and payload["timeout"] == "hang_timeout_s"


def test_older_smaller_shapes_read_as_a_fault():
    beat = {"event_id": "fault/0-40/ex/1", "kind": "crash", "fault_ts": 1.0,
            "detected_ts": 1.0, "last_step": 5}
    assert Fault.from_json(beat) == Fault("crash", event_id="fault/0-40/ex/1", fault_ts=1.0,
                                          detected_ts=1.0, last_step=5)
    legacy = Fault.from_error_details(
        [{"node": "h1", "fault_kind": "nccl", "evidence": "NCCL error", "peer": True,
          "fault_event_id": "fault/n", "fault_ts": 2.0, "detected_ts": 3.0, "last_step": 9,
          "fingerprint": "nccl at step 9", "transient": False}], error_type="NodeFailed")
    assert (legacy.kind, legacy.node, legacy.peer, legacy.event_id, legacy.detection_s) == (
        "nccl", "h1", True, "fault/n", 1.0)
    bare = Fault.from_error_details((), error_type="HardwareFault", message="rank 0 died")
    assert (bare.kind, bare.evidence) == ("HardwareFault", "rank 0 died")


def test_one_writer_puts_the_record_in_the_log_at_its_step_under_its_id(tmp_path):
    events = EventLog(str(tmp_path), "r", "supervisor", attempt=1)
    record_fault(events, HANG)
    events.flush()
    [event] = read_events(str(tmp_path), "r")
    assert (event["kind"], event["event_id"], event["step"]) == ("fault", HANG.event_id, 12)
    assert Fault.from_json(event["payload"]) == HANG
    assert fault_event(HANG) == ("fault", HANG.event_id, HANG.to_json())


def test_the_recovered_that_closes_a_fault_has_the_id_derived_from_it():
    assert recovered_id("fault/0-40/ex/1") == "recovered/fault/0-40/ex/1"


@given(st.floats(1.7e9, 1.9e9), st.floats(0.0, 120.0))
def test_the_detection_a_recovery_reports_is_the_one_its_fault_event_says(fault_ts, wait):
    # the two events are read side by side: from raw times, 4.8895 s read as 4.89 on one
    # and 4.889 on the other
    detected_ts = fault_ts + wait
    said = Fault("worker_lost", fault_ts=fault_ts, detected_ts=detected_ts).detection_s
    assert detection_between(fault_ts, detected_ts) == said
    assert detection_between(to_ms(fault_ts), to_ms(detected_ts)) == said


def test_times_that_round_apart_give_the_logs_detection_not_the_raw_difference():
    fault_ts, detected_ts = 1743697860.0126, 1743697864.9021
    assert round(detected_ts - fault_ts, 3) == 4.89
    assert detection_between(fault_ts, detected_ts) == 4.889  # 864.902 - 860.013
