"""The life of a fault (docs/faults.md), one kind at a time: the record its detector makes
(common/faults.py Fault) is the record in its `fault` event, in the heartbeat, in the
failure the workflow receives and in the workflow's decision (workflows/adapt.py decide,
workflows/gang.py member_failure and blame), unchanged but for what the recorder adds:
where it struck and its identity. Real detectors, a real event log on local files."""

from __future__ import annotations

import dataclasses

import pytest
from temporalio.exceptions import TimeoutError, TimeoutType

from activities.child_exit import classify_exit, hung
from activities.contracts import TrainSegmentInput
from activities.errors import to_application_error
from activities.gang_member import node_failed
from activities.hang import Timeout
from activities.heartbeat import Beat
from activities.recovery import FaultRecorder, server_outage
from activities.server_watch import ServerWatch
from common.errors import HardwareFault, StorageUnavailable
from common.fault_kinds import FAULT_KINDS
from common.faults import Fault, Repeat, fault_event
from common.protocol import StepLine
from storage.checkpoints import emit_corrupt
from storage.events import EventLog, read_events
from storage.manifest import CorruptCheckpoint
from tests.workflows.test_adapt import activity_error, spec
from workflows.adapt import decide
from workflows.carry import RunCarry
from workflows.gang import LOST, blame, member_failure

INP = TrainSegmentInput(spec={}, dataset_uri="", from_step=0, to_step=40)

# what the supervisor sees of a child that failed: (exit code, its last log line, oom kills)
CHILD_EXITS = {
    "rank_lost": (-9, "", 0),
    "oom": (-9, "", 1),
    "crash": (1, "RuntimeError: shape mismatch", 0),
    "nccl": (1, "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)", 0),
    "cuda": (1, "RuntimeError: CUDA error: an illegal memory access was encountered", 0),
    "ecc": (1, "RuntimeError: uncorrectable ECC error encountered", 0),
    "preempted": (-15, "", 0),
}
SUPERVISED = (*CHILD_EXITS, "hang", "storage_outage")
ELSEWHERE = ("worker_lost", "server_unavailable", "checkpoint_corrupt")


def test_the_walk_covers_every_fault_kind():
    assert {*SUPERVISED, *ELSEWHERE} == set(FAULT_KINDS)


def detect(kind: str, tmp_path) -> Fault:
    """The detector's own record of `kind` (activities/child_exit.py's, or an error of the
    activity's own for the recorder's on_error: see `walk`)."""
    log_path = tmp_path / "child.log"
    seen: list[Fault] = []
    if kind == "hang":
        timeout = Timeout("hang_timeout_s", 60.0, 0.0, "step", True, "auto", 0.5, 12, 7)
        hung(timeout, 61.0, str(tmp_path), str(log_path), 100.0, seen.append)
        return seen[0]
    rc, line, oom_kills = CHILD_EXITS[kind]
    log_path.write_text(f"{line}\n")
    with pytest.raises(HardwareFault):
        classify_exit(rc, str(tmp_path), str(log_path), seen.append, oom_kills=oom_kills)
    return seen[0]


def set_fields(fault: Fault) -> dict:
    return {k: v for k, v in vars(fault).items() if v not in (None, "", (), 0, False, {})}


@pytest.mark.parametrize("kind", SUPERVISED)
def test_a_supervised_fault_is_one_record_from_its_detector_to_the_workflows_decision(
        tmp_path, kind):
    store = str(tmp_path / "store")
    beats: list[tuple[Fault, Repeat]] = []
    recorder = FaultRecorder(EventLog(store, "r", "supervisor", attempt=1), INP, 1, "ex",
                             heartbeat=lambda f, r: beats.append((f, r)))
    recorder.on_progress(StepLine(step=7, loss=1.0, lr=1e-3))
    if kind == "storage_outage":
        recorder.on_error(StorageUnavailable("file:///store", "connection refused"))
        seen = Fault("storage_outage")
    else:
        seen = detect(kind, tmp_path)
        recorder.on_failure(seen)
    fault = recorder.fault
    assert fault is not None and fault.kind == kind
    # the detector's record, carried unchanged; the recorder adds where and which
    assert set_fields(seen).items() <= set_fields(fault).items()
    assert (fault.event_id, fault.detected_by, fault.attempt, fault.last_step) == (
        "fault/0-40/ex/1", "supervisor", 1, 7)
    # the event is the record
    [event] = read_events(store, "r", kinds=("fault",))
    assert event["event_id"] == fault.event_id and event["step"] == 7
    assert Fault.from_json(event["payload"]) == fault
    # so is the heartbeat the next attempt reads
    [(beaten, _)] = beats
    assert Beat.from_details([Beat(fault=beaten).to_json()]).fault == fault
    # and the failure the workflow decides on
    if kind == "oom":
        error = to_application_error(recorder.decision("r", limit=3, micro_split=1))
        decision = decide(spec(), 1, error)
        assert decision.micro_split == 2 and decision.after_fault == fault
    member = member_failure("h1", activity_error(to_application_error(
        node_failed("h1", recorder))))
    assert member.fault == dataclasses.replace(fault, node="h1", peer=member.fault.peer)
    verdict = blame(RunCarry(), spec(), [member], lo=0, hi=40, launch=0, now=200.0)
    assert verdict.after_fault == member.fault


def test_a_lost_worker_is_recorded_by_the_workflow_and_answered_by_the_next_launch(tmp_path):
    store = str(tmp_path / "store")
    member = member_failure("h1", activity_error(TimeoutError(
        "heartbeat", type=TimeoutType.HEARTBEAT, last_heartbeat_details=[])))
    assert (member.how, member.fault.kind, member.fault.detected_by) == (
        LOST, "worker_lost", "workflow")
    verdict = blame(RunCarry(), spec(), [member], lo=0, hi=40, launch=0, now=200.0)
    [(kind, event_id, payload)] = verdict.events
    assert (kind, event_id, payload) == fault_event(verdict.after_fault)
    with EventLog(store, "r", "workflow") as events:  # as the record_event activity does
        events.emit(kind, payload, event_id=event_id)
    [event] = read_events(store, "r", kinds=("fault",))
    assert Fault.from_json(event["payload"]) == verdict.after_fault
    # the carry takes it to the next launch, whose recovery answers it
    carried = RunCarry.from_json(RunCarry(after_fault=verdict.after_fault).to_json())
    assert carried.after_fault == verdict.after_fault


def test_a_server_outage_is_recorded_by_the_watch_and_read_back_by_the_retry(tmp_path):
    store = str(tmp_path / "store")
    progress = tmp_path / "progress.jsonl"
    progress.write_text("")
    watch = ServerWatch(lambda: "", EventLog(store, "r", "server-watch", attempt=1),
                        id_base="0-40/ex/1", segment="0-40", address="127.0.0.1:7233",
                        progress_file=str(progress))
    for error, now in (("", 100.0), ("down", 102.0), ("down", 104.0)):
        watch.observe(error, now)
    fault = watch.outage
    assert fault is not None and (fault.kind, fault.detected_by) == (
        "server_unavailable", "server_watch")
    [event] = read_events(store, "r", kinds=("fault",))
    assert Fault.from_json(event["payload"]) == fault
    # the attempt the server retries answers this outage, not a worker_lost of its own
    assert server_outage(EventLog(store, "r", "supervisor", attempt=2), INP, "ex", 1) == fault


def test_a_corrupt_checkpoint_event_reads_as_the_record(tmp_path):
    # its writer is still the storage layer's own (storage/checkpoints.py emit_corrupt)
    with EventLog(str(tmp_path), "r", "trainer") as events:
        emit_corrupt(events, CorruptCheckpoint(20, "model.pt", "abc", "abd"))
    [event] = read_events(str(tmp_path), "r", kinds=("fault",))
    fault = Fault.from_json(event["payload"])
    assert (fault.kind, fault.detected_by, fault.evidence) == (
        "checkpoint_corrupt", "trainer", "model.pt: expected abc, found abd")
