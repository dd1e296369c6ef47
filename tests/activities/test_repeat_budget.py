"""The repeated-failure budget's pure parts (activities/recovery.py, common/faults.py Repeat):
what makes two failures the same, how a run of them is counted across attempts, and what it
leads to."""

from __future__ import annotations

import dataclasses

from activities.recovery import fingerprint, fix_for, prior_repeat
from common.faults import Fault, Repeat

CRASH = Fault("crash", last_step=29, error_type="RuntimeError", frame="faults.py:118 in starting")


def signed(kind: str, sig: str) -> Fault:
    return Fault(kind, fingerprint=sig)


def test_the_fingerprint_is_kind_step_exception_type_and_frame():
    sig = fingerprint(CRASH)
    assert sig == "crash at step 29 RuntimeError faults.py:118 in starting"
    assert fingerprint(dataclasses.replace(CRASH, last_step=30)) != sig
    assert fingerprint(dataclasses.replace(CRASH, frame="model.py:9 in forward")) != sig
    assert "SIGKILL" in fingerprint(Fault("rank_lost", last_step=3, signal="SIGKILL"))


def test_the_same_failure_counts_up_and_another_starts_again_at_one():
    first = Repeat().after(signed("crash", "a"))
    second = first.after(signed("crash", "a"))
    assert (first.repeats, second.repeats) == (1, 2)
    assert second.after(signed("crash", "b")) == Repeat("b", 1)


def test_a_transient_failure_neither_counts_nor_breaks_the_run():
    run = Repeat("a", 2)
    for kind in ("worker_lost", "storage_outage", "preempted", "server_unavailable"):
        assert run.after(signed(kind, f"{kind} at step 5")) == run
    assert Repeat().after(signed("worker_lost", "x")) == Repeat()


def test_the_run_of_failures_travels_in_the_heartbeat_details():
    assert prior_repeat(({"step": 10, "repeat": {"fingerprint": "a", "repeats": 2}},)) == \
        Repeat("a", 2)
    assert prior_repeat(()) == Repeat() and prior_repeat(None) == Repeat()
    assert prior_repeat(("x",)) == Repeat()
    assert Repeat.from_json(Repeat("a", 2).to_json()) == Repeat("a", 2)


def test_the_fix_names_the_run_to_resume_and_what_to_look_at():
    assert "`mainspring run resume r1`" in fix_for("crash", "r1")
    assert "traceback" in fix_for("crash", "r1") and "--skip-data" in fix_for("crash", "r1")
    assert "out of service" in fix_for("ecc", "r1")
