"""A fault has one `recovered`, with one MTTR, however many closers see its end.

A Temporal outage longer than the heartbeat timeout has two: the server watch of the
attempt that was running (activities/server_watch.py) sees the server answer again, and the
attempt the server retries when it is back (activities/recovery.py:Recovery) answers the
outage it reads from the event log at its first step. Both wrote a `recovered` for the
one fault (in a chaos run: 18.0 s and 69.1 s). Driven here against a real event log on
local files, in both orders."""

from __future__ import annotations

import json

from activities.recovery import Recovery
from activities.server_watch import ServerWatch
from common.protocol import StartLine, StepLine
from storage.events import EventLog, read_events
from tests.activities.retries import retry_attempt


def outage(tmp_path, store: str) -> ServerWatch:
    """Attempt 1's watch: the server answered at 100, then two probes failed."""
    progress = tmp_path / "progress.jsonl"
    progress.write_text(json.dumps({"type": "step", "step": 10, "ts": 101.0, "loss": 1.0,
                                    "lr": 1e-3, "verdict": "ok"}) + "\n")
    w = ServerWatch(lambda: "", EventLog(store, "r1", "server-watch", attempt=1),
                    id_base="0-40/ex/1", segment="0-40", address="127.0.0.1:7233",
                    progress_file=str(progress))
    w.observe("", 100.0)
    w.observe("down", 102.0)
    w.observe("down", 104.0)
    return w


def retry(tmp_path, store: str) -> Recovery:
    """Attempt 2, retried by the server when it was back: no fault in attempt 1's heartbeat,
    so it answers the outage the watch recorded; its first step is its recovery."""
    return retry_attempt(tmp_path, store, {"step": 10, "ts": 101.0}, 160.0,
                         StartLine(resumed_from=10, world_size=1, to_step=40, attempt=2,
                                   ts=165.0),
                         StepLine(step=11, loss=1.0, lr=1e-3, ts=169.1))


def closing_events(store: str) -> tuple[list[dict], list[dict]]:
    return (read_events(store, "r1", kinds=("fault",)),
            read_events(store, "r1", kinds=("recovered",)))


def test_an_outage_past_the_heartbeat_timeout_has_one_recovered_when_the_watch_closes_it_first(
        tmp_path):
    store = str(tmp_path / "store")
    watch = outage(tmp_path, store)
    watch.observe("", 118.0)  # the server is back: the watch closes the outage
    retry(tmp_path, store)  # then the retried attempt reaches its first step
    [fault], recovered = closing_events(store)
    assert [r["payload"]["fault_event_id"] for r in recovered] == [fault["event_id"]]
    assert recovered[0]["payload"]["mttr_s"] == 18.0


def test_an_outage_past_the_heartbeat_timeout_has_one_recovered_when_the_retry_closes_it_first(
        tmp_path):
    store = str(tmp_path / "store")
    watch = outage(tmp_path, store)
    retry(tmp_path, store)  # the retried attempt's first step, before the watch's next probe
    watch.observe("", 170.0)
    [fault], recovered = closing_events(store)
    assert [r["payload"]["fault_event_id"] for r in recovered] == [fault["event_id"]]
    assert recovered[0]["payload"]["mttr_s"] == 69.1
