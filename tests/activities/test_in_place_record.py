"""The record of restarts in place (activities/recovery.py): a launch that fails
before its first step does not leave its own fault unanswered when the next launch
recovers."""

from __future__ import annotations

from activities.contracts import TrainSegmentInput
from activities.recovery import FaultRecorder, Recovery
from common.faults import Fault
from common.protocol import StartLine, StepLine
from ops.goodput import fault_summary
from storage.events import EventLog, read_events


def crash(why: str) -> Fault:
    return Fault("crash", why, exit_code=1, rank=0, fault_ts=100.0, detected_ts=100.5)


def test_a_launch_that_died_before_its_first_step_is_answered_by_the_restart_that_recovers(
        tmp_path):
    durable = str(tmp_path / "durable")
    events = EventLog(durable, "r", "supervisor", attempt=2)
    inp = TrainSegmentInput(spec={}, dataset_uri="", from_step=0, to_step=300)
    faults = FaultRecorder(events, inp, 2, "ex", heartbeat=lambda *_: None)
    faults.on_failure(crash("rank 0 exit code 1"))  # the attempt's first launch
    first = Recovery(events, str(tmp_path), inp, 2, "ex", in_place=faults)
    faults.restarted()
    first.on_progress(StartLine(resumed_from=10, world_size=2, to_step=300, attempt=2,
                                restart=1))
    faults.on_failure(crash("rank 0 exit code 1, again"))  # died before its first step
    second = Recovery(events, str(tmp_path), inp, 2, "ex", in_place=faults, unanswered=first)
    faults.restarted()
    second.on_progress(StartLine(resumed_from=10, world_size=2, to_step=300, attempt=2,
                                 restart=2))
    second.on_progress(StepLine(step=11, loss=1.0, lr=0.1))

    got = read_events(durable, "r")
    recovered = [e for e in got if e["kind"] == "recovered"]
    assert [r["payload"]["fault_event_id"] for r in recovered] == ["fault/0-300/ex/2.1"]
    assert recovered[0]["payload"]["also_answers"] == ["fault/0-300/ex/2"]
    summary, _ = fault_summary(got)
    assert summary["crash"]["count"] == 2 and summary["crash"]["recovered"] == 2


def test_a_restart_after_a_launch_that_recovered_answers_only_its_own_fault(tmp_path):
    durable = str(tmp_path / "durable")
    events = EventLog(durable, "r", "supervisor", attempt=1)
    inp = TrainSegmentInput(spec={}, dataset_uri="", from_step=0, to_step=300)
    faults = FaultRecorder(events, inp, 1, "ex", heartbeat=lambda *_: None)
    faults.on_failure(crash("rank 0 exit code 1"))
    first = Recovery(events, str(tmp_path), inp, 1, "ex", in_place=faults)
    faults.restarted()
    first.on_progress(StartLine(resumed_from=10, world_size=2, to_step=300, attempt=1,
                                restart=1))
    first.on_progress(StepLine(step=11, loss=1.0, lr=0.1))
    faults.on_failure(crash("rank 0 exit code 1 at step 20"))
    second = Recovery(events, str(tmp_path), inp, 1, "ex", in_place=faults, unanswered=first)
    assert second.also == []
