"""`mainspring events` prints a run's log as it reads it (storage/events.py stream_events):
the same lines, in the same order, as the whole log read at once."""

from __future__ import annotations

import json

import ops.cli_events as cli_events
from ops.cli import main
from storage.events import EventLog, read_events

T0 = 1_700_000_000.0


def write(store: str, writers: int = 3, batches: int = 4) -> None:
    """Writers whose batches interleave in time."""
    for w in range(writers):
        log = EventLog(store, "r", f"w{w}")
        for b in range(batches):
            for i in range(3):
                log.emit("tick", step=b, n=i)["ts"] = T0 + b * 100 + i * 10 + w
            log.flush()


def test_events_prints_the_log_in_read_events_order(tmp_path, capsys, monkeypatch):
    store = str(tmp_path / "store")
    write(store)
    monkeypatch.setattr(cli_events, "CHECK_CHUNK", 5)  # several chunks of a small log
    capsys.readouterr()
    assert main(["events", "r", "--durable", store, "--json"]) == 0
    printed = [json.loads(line)["event_id"] for line in capsys.readouterr().out.splitlines()]
    assert printed == [e["event_id"] for e in read_events(store, "r")] and len(printed) == 36


def test_a_chunk_of_unusable_events_does_not_end_the_listing(tmp_path, capsys, monkeypatch):
    store = str(tmp_path / "store")
    with EventLog(store, "r", "w") as log:
        for i in range(6):  # the first four's times out of range: dropped by the check
            log.emit("tick", n=i)["ts"] = -10.0 + i if i < 4 else T0 + i
    monkeypatch.setattr(cli_events, "CHECK_CHUNK", 2)
    capsys.readouterr()
    assert main(["events", "r", "--durable", store, "--json"]) == 0
    printed = [json.loads(line)["payload"]["n"] for line in capsys.readouterr().out.splitlines()]
    assert printed == [4, 5]
