"""One fault, one recovery, as a rule (activities/fault_ledger.py): given the event log's
faults and recoveries and the previous attempt's heartbeat, which fault a retry closes and
whether it must first write the loss (worker_lost). Pure: no Temporal, no store."""

from __future__ import annotations

from activities.fault_ledger import Answer, answer, ledger, segment_prefix
from activities.heartbeat import Beat
from common.faults import Fault, fault_event, recovered_id

PREFIX = segment_prefix(0, 40, "ex")
HANG = Fault("hang", "rank 1 is stopped", event_id=PREFIX + "1", attempt=1,
             fault_ts=100.0, detected_ts=130.1)
DECIDED = Fault("oom", "out of memory", event_id="fault/0-40/earlier/1")


def fault_at(fault: Fault, ts: float = 0.0) -> dict:
    kind, event_id, payload = fault_event(fault)
    return {"kind": kind, "event_id": event_id, "payload": payload, "ts": ts, "step": None}


def recovered(fault_id: str, *also: str) -> dict:
    payload = {"fault_event_id": fault_id, **({"also_answers": list(also)} if also else {})}
    return {"kind": "recovered", "event_id": recovered_id(fault_id), "payload": payload,
            "ts": 0.0, "step": None}


def test_a_retry_after_a_loss_that_followed_an_in_place_recovery_writes_its_own_worker_lost():
    # attempt 1's hang was recovered in place; its restart's worker was then SIGKILLed,
    # and its last heartbeat still carried the hang (as a worker of the old version beat it)
    book = ledger([fault_at(HANG), recovered(HANG.event_id)], PREFIX)
    got = answer(2, PREFIX, prior=HANG, decided=None, beat_launch=0, book=book)
    assert got == Answer(PREFIX + "1.1", None, (), 1)
    assert got.worker_lost


def test_a_retry_whose_predecessors_restart_died_before_a_step_closes_the_hang_as_well():
    book = ledger([fault_at(HANG)], PREFIX)  # the restart never reached its first step
    got = answer(2, PREFIX, prior=None, decided=None, beat_launch=1, book=book)
    assert (got.event_id, got.worker_lost, got.also) == (PREFIX + "1.1", True,
                                                         (HANG.event_id,))


def test_a_fault_the_log_holds_but_the_heartbeat_missed_is_answered_with_no_worker_lost():
    book = ledger([fault_at(HANG)], PREFIX)
    got = answer(2, PREFIX, prior=None, decided=None, beat_launch=0, book=book)
    assert (got.event_id, got.fault, got.also) == (HANG.event_id, HANG, ())
    assert not got.worker_lost


def test_a_heartbeat_fault_whose_event_never_reached_the_log_is_still_answered():
    got = answer(2, PREFIX, prior=HANG, decided=None, beat_launch=0, book=ledger([], PREFIX))
    assert (got.event_id, got.fault) == (HANG.event_id, HANG)


def test_a_decided_fault_already_recovered_is_answered_by_nobody_again():
    book = ledger([recovered(DECIDED.event_id)], PREFIX)
    assert answer(1, PREFIX, prior=None, decided=DECIDED, book=book) == Answer()
    got = answer(2, PREFIX, prior=None, decided=DECIDED, book=book)
    assert (got.event_id, got.worker_lost, got.also) == (PREFIX + "1", True, ())


def test_a_decided_fault_left_open_by_a_lost_first_attempt_is_closed_with_the_worker_lost():
    assert answer(1, PREFIX, prior=None, decided=DECIDED, book=ledger([], PREFIX)).fault \
        == DECIDED
    got = answer(2, PREFIX, prior=None, decided=DECIDED, book=ledger([], PREFIX))
    assert (got.event_id, got.worker_lost, got.also) == (PREFIX + "1", True,
                                                         (DECIDED.event_id,))


def test_an_earlier_retrys_unanswered_worker_lost_is_closed_by_the_next_recovery():
    lost = Fault("worker_lost", event_id=PREFIX + "1", attempt=1)
    got = answer(3, PREFIX, prior=None, decided=None, book=ledger([fault_at(lost)], PREFIX))
    assert (got.event_id, got.worker_lost, got.also) == (PREFIX + "2", True, (PREFIX + "1",))


def test_with_the_log_unread_the_loss_is_written_and_no_decided_fault_is_named():
    got = answer(2, PREFIX, prior=None, decided=DECIDED, beat_launch=2, book=None)
    assert (got.event_id, got.worker_lost, got.also) == (PREFIX + "1.2", True, ())


def test_another_executions_faults_and_malformed_records_are_skipped_not_raised():
    other = Fault("crash", event_id="fault/0-40/other/1")
    bad_fault = {"kind": "fault", "event_id": PREFIX + "1", "ts": 0.0, "step": None,
                 "payload": {"kind": "hang", "fault_ts": "yesterday"}}
    bad_step = {"kind": "fault", "event_id": PREFIX + "1.1", "ts": 0.0, "step": None,
                "payload": {"kind": "crash", "last_step": "12", "attempt": 1e300}}
    bad_recovered = {"kind": "recovered", "event_id": "recovered/x", "ts": 0.0, "step": None,
                     "payload": {"fault_event_id": ["nested"], "also_answers": {"a": 1}}}
    book = ledger([fault_at(other), bad_fault, bad_step, bad_recovered], PREFIX)
    assert dict(book.faults) == {} and book.closed == frozenset({"x"})
    assert answer(2, PREFIX, prior=None, decided=None, book=book).worker_lost


def test_the_heartbeat_names_the_running_launch_and_reads_a_malformed_one_as_the_first():
    assert Beat.from_details([Beat(restart=2).to_json()]).restart == 2
    assert "restart" not in Beat().to_json()  # an older reader's shape, unchanged
    for bad in ("2", True, -1, 10**9, 2.5):
        assert Beat.from_details([{"restart": bad}]).restart == 0
