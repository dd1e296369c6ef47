"""A worker lost right after an in-place recovery is an incident of its own
(activities/recovery.py Recovery, activities/fault_ledger.py): the retry writes its
worker_lost, with its own detection evidence, and recovers that; the hang its restart in
place already recovered is never named again. In a chaos run the retry's `recovered` named
the hang a second time (mttr 62.9 s, the hang's detection_s) and the loss had no record.
Driven against a real event log on local files, through Temporal's activity environment."""

from __future__ import annotations

from temporalio.testing import ActivityEnvironment

from activities.heartbeat import Beat, DurableCommit
from activities.recovery import FaultRecorder, Recovery
from common.faults import Fault
from common.protocol import StartLine, StepLine
from ops.goodput import fault_summary
from storage.events import EventLog, read_events
from tests.activities.retries import INP, retry_attempt

HUNG_AT, HANG_SEEN = 100.0, 130.1  # the last step line before the hang; the timeout firing
LAST_BEAT, RETRY_SCHEDULED = 150.0, 158.0  # the killed worker's last beat; the timeout


def hang() -> Fault:
    return Fault("hang", "hang_timeout_s 30s passed; rank 1 is stopped", rank=1,
                 fault_ts=HUNG_AT, detected_ts=HANG_SEEN)


def in_place_recovery(store: str, tmp_path) -> dict:
    """Attempt 1: a hang, restarted in place and recovered at the restart's first step, as
    activities/training.py wires the recorder to the heartbeat. Returns the heartbeat
    details the server holds when the worker is then SIGKILLed."""
    env = ActivityEnvironment()

    def attempt_one() -> dict:
        events = EventLog(store, "r1", "supervisor", attempt=1)
        tracker = DurableCommit(10, "file:///ckpt/10")
        faults = FaultRecorder(events, INP, 1, "ex", tracker.on_fault,
                               on_restart=tracker.on_restart)
        faults.on_progress(StepLine(step=12, loss=1.0, lr=1e-3, ts=HUNG_AT))
        faults.on_failure(hang())
        restart = Recovery(events, str(tmp_path), INP, 1, "ex", in_place=faults)
        faults.restarted()
        restart.on_progress(StartLine(resumed_from=10, world_size=2, to_step=40, attempt=1,
                                      restart=1, ts=131.0))
        restart.on_progress(StepLine(step=11, loss=1.0, lr=1e-3, ts=HUNG_AT + 30.5))
        return dict(tracker.details(), ts=LAST_BEAT)

    return env.run(attempt_one)


def retry(store: str, tmp_path, details: dict) -> Recovery:
    """Attempt 2, scheduled when the killed worker's heartbeat timed out; its first step."""
    return retry_attempt(tmp_path, store, details, RETRY_SCHEDULED,
                         StartLine(resumed_from=20, world_size=2, to_step=40, attempt=2,
                                   ts=165.0),
                         StepLine(step=21, loss=1.0, lr=1e-3, ts=170.0))


def assert_one_recovery_per_incident(store: str) -> dict:
    """The hang and the loss: each its own fault, each closed by exactly one `recovered`."""
    events = read_events(store, "r1")
    faults = {e["event_id"]: e["payload"] for e in events if e["kind"] == "fault"}
    closers = [e["payload"] for e in events if e["kind"] == "recovered"]
    assert [f["kind"] for f in faults.values()] == ["hang", "worker_lost"], faults
    named = [r["fault_event_id"] for r in closers]
    assert sorted(named) == sorted(faults) and len(set(named)) == len(named), named
    summary, _ = fault_summary(events)
    assert summary["hang"]["recovered"] == summary["worker_lost"]["recovered"] == 1
    [(lost_id, lost)] = [(i, f) for i, f in faults.items() if f["kind"] == "worker_lost"]
    [answer] = [r for r in closers if r["fault_event_id"] == lost_id]
    # its own evidence: the last beat to the retry's scheduling, not the hang's 30.1 s
    assert lost["detection_s"] == answer["detection_s"] == RETRY_SCHEDULED - LAST_BEAT
    assert answer["mttr_s"] == 170.0 - LAST_BEAT and "also_answers" not in answer
    return lost


def test_a_worker_lost_after_an_in_place_recovery_gets_its_own_fault_and_recovery(tmp_path):
    store = str(tmp_path / "store")
    details = in_place_recovery(store, tmp_path)
    # the restart took the hang out of the heartbeat and named the running launch instead
    assert Beat.from_details([details]).fault is None
    assert Beat.from_details([details]).restart == 1
    retry(store, tmp_path, details)
    lost = assert_one_recovery_per_incident(store)
    assert (lost["attempt"], lost["restart"], lost["detected_by"]) == (1, 1, "next_attempt")


def test_a_retry_whose_heartbeat_still_names_a_recovered_hang_writes_the_loss_instead(
        tmp_path):
    # a heartbeat from before the restart cleared it (an older worker, a lost last beat):
    # the event log, not the heartbeat, says the hang is closed
    store = str(tmp_path / "store")
    in_place_recovery(store, tmp_path)
    [hang_event] = read_events(store, "r1", kinds=("fault",))
    stale = Beat(step=10, uri="file:///ckpt/10", ts=LAST_BEAT,
                 fault=Fault.from_json(hang_event["payload"])).to_json()
    retry(store, tmp_path, stale)
    assert_one_recovery_per_incident(store)
