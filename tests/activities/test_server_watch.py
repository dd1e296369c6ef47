"""The server watch's decision (activities/server_watch.py:ServerWatch.observe): probe results
and the trainer's progress lines in, one `fault`/`recovered` pair per outage out, into a
real event log on local files."""

from __future__ import annotations

import json

from activities.server_watch import ServerWatch
from storage.events import EventLog, read_events


def watch(tmp_path, misses: int = 2) -> tuple[ServerWatch, str, object]:
    store = str(tmp_path / "store")
    progress = tmp_path / "progress.jsonl"
    progress.write_text("")
    w = ServerWatch(lambda: "", EventLog(store, "r1", "server-watch", attempt=1),
                    id_base="0-40/abc/1", segment="0-40", address="127.0.0.1:7233",
                    progress_file=str(progress), misses=misses)
    return w, store, progress


def step(progress, n: int, ts: float) -> None:
    with open(progress, "a") as f:
        f.write(json.dumps({"type": "step", "step": n, "ts": ts, "loss": 1.0, "lr": 1e-3,
                            "verdict": "ok"}) + "\n")


def test_one_failed_probe_is_no_outage_and_two_in_a_row_are_one(tmp_path):
    w, store, progress = watch(tmp_path)
    w.observe("", 100.0)
    w.observe("Unavailable", 102.0)
    w.observe("", 104.0)  # one slow answer
    assert read_events(store, "r1") == []
    step(progress, 10, 105.0)
    w.observe("Unavailable", 106.0)
    w.observe("Unavailable", 108.0)
    w.observe("Unavailable", 110.0)  # still the same outage
    [fault] = read_events(store, "r1", kinds=("fault",))
    p = fault["payload"]
    assert p["kind"] == "server_unavailable" and p["injected"] is False
    assert p["fault_ts"] == 104.0 and p["detection_s"] == 4.0 and p["last_step"] == 10
    assert "127.0.0.1:7233" in p["evidence"] and "Unavailable" in p["evidence"]


def test_the_next_answer_is_the_recovery_with_the_steps_trained_meanwhile(tmp_path):
    w, store, progress = watch(tmp_path)
    w.observe("", 100.0)
    step(progress, 10, 101.0)
    w.observe("down", 102.0)
    w.observe("down", 104.0)
    step(progress, 30, 120.0)  # the trainer trained on
    w.observe("", 124.0)
    [fault] = read_events(store, "r1", kinds=("fault",))
    [rec] = read_events(store, "r1", kinds=("recovered",))
    r = rec["payload"]
    assert r["fault_event_id"] == fault["event_id"]
    assert (r["steps_during_outage"], r["lost_steps"], r["child_restarted"]) == (20, 0, False)
    assert r["outage_s"] == 24.0 and r["mttr_s"] == 24.0
    # a second outage of the same attempt is a pair of its own
    w.observe("down", 126.0)
    w.observe("down", 128.0)
    w.observe("", 130.0)
    faults = read_events(store, "r1", kinds=("fault",))
    assert len(faults) == 2 and len({f["event_id"] for f in faults}) == 2
    assert len(read_events(store, "r1", kinds=("recovered",))) == 2
