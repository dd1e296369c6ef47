"""`mainspring events --follow`'s end: the run has finished when its newest event is
`run_finished`, also where another event shares its time to the last digit (the workflow
writes the stage's end and the run's in one moment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ops.cli_events import Finished
from storage.events import EventLog

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def event(kind: str, ts: float) -> dict:
    return {"kind": kind, "ts": ts, "event_id": f"{kind}/{ts}", "payload": {}, "step": None}


def test_a_run_finished_at_the_same_time_as_its_last_stage_is_finished_in_either_order():
    for order in (("stage_finished", "run_finished"), ("run_finished", "stage_finished")):
        finished = Finished()
        finished.see(event("run_started", 1.0))
        assert not finished()
        for kind in order:
            finished.see(event(kind, 5.0))
        assert finished(), order


def test_a_run_started_again_after_it_finished_is_not_finished():
    finished = Finished()
    for kind, ts in (("run_finished", 5.0), ("run_started", 6.0), ("stage_started", 6.0)):
        finished.see(event(kind, ts))
    assert not finished()
    finished.see(event("run_finished", 9.0))
    assert finished()
    finished.see(event("fault", 8.0))  # a late batch's older event changes nothing
    assert finished()


def test_follow_ends_on_a_run_whose_last_two_events_share_their_time(tmp_path):
    store = str(tmp_path / "store")
    with EventLog(store, "r1", "workflow") as log:
        log.emit("run_started")["ts"] = 1_700_000_000.0
        for e in (log.emit("stage_finished", stage="train"), log.emit("run_finished")):
            e["ts"] = 1_700_000_100.0  # one moment, to the last digit of the float
    proc = subprocess.run([sys.executable, "-m", "ops.cli", "events", "r1", "--durable", store,
                           "--follow", "--json", "--poll-s", "0.2"],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert proc.returncode == 0 and proc.stderr == ""
    kinds = [json.loads(line)["kind"] for line in proc.stdout.splitlines()]
    assert kinds[0] == "run_started" and sorted(kinds[1:]) == ["run_finished", "stage_finished"]
