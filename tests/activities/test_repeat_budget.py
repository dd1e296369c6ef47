"""The repeated-failure budget's pure parts (activities/recovery.py): what makes two failures
the same, how a run of them is counted across attempts, and what it leads to."""

from __future__ import annotations

from activities.recovery import count_repeat, fingerprint, fix_for, prior_repeat

CRASH = {"kind": "crash", "last_step": 29, "error_type": "RuntimeError",
         "frame": "faults.py:118 in starting"}


def test_the_fingerprint_is_kind_step_exception_type_and_frame():
    sig = fingerprint(CRASH)
    assert sig == "crash at step 29 RuntimeError faults.py:118 in starting"
    assert fingerprint({**CRASH, "last_step": 30}) != sig
    assert fingerprint({**CRASH, "frame": "model.py:9 in forward"}) != sig
    assert "SIGKILL" in fingerprint({"kind": "rank_lost", "last_step": 3, "signal": "SIGKILL"})


def test_the_same_failure_counts_up_and_another_starts_again_at_one():
    first = count_repeat({}, "crash", "a")
    second = count_repeat(first, "crash", "a")
    assert (first["repeats"], second["repeats"]) == (1, 2)
    assert count_repeat(second, "crash", "b") == {"fingerprint": "b", "repeats": 1}


def test_a_transient_failure_neither_counts_nor_breaks_the_run():
    run = {"fingerprint": "a", "repeats": 2}
    for kind in ("worker_lost", "storage_outage", "preempted"):
        assert count_repeat(run, kind, f"{kind} at step 5") == run
    assert count_repeat({}, "worker_lost", "x") == {}


def test_the_run_of_failures_travels_in_the_heartbeat_details():
    assert prior_repeat(({"step": 10, "repeat": {"fingerprint": "a", "repeats": 2}},)) == {
        "fingerprint": "a", "repeats": 2}
    assert prior_repeat(()) == {} and prior_repeat(None) == {} and prior_repeat(("x",)) == {}


def test_the_fix_names_the_run_to_resume_and_what_to_look_at():
    assert "`mainspring run resume r1`" in fix_for("crash", "r1")
    assert "traceback" in fix_for("crash", "r1") and "--skip-data" in fix_for("crash", "r1")
    assert "out of service" in fix_for("ecc", "r1")
