"""`follow`'s catch-up streams (storage/event_batches.py `sweep`): a long log is read a group of
batches at a time, in time order, and never held whole; each event once, as read_events
has it."""

from __future__ import annotations

import os

import pytest

import storage.events as events_module
from storage.event_batches import parse_batch, sweep
from storage.events import (
    EventLog,
    _batches,
    follow,
    list_batches,
    load_batches,
    read_events,
    stream_events,
)
from storage.fs import resolve

T0 = 1_700_000_000.0


def write_hours(url: str, hours: int, per_batch: int = 5, writers: int = 1) -> None:
    """`hours` batches per writer, one an hour, `per_batch` events each; writers interleave
    in time (a second writer's hour overlaps the first's), and the last writer re-emits
    the first event of each hour later, as a retried activity does."""
    for w in range(writers):
        log = EventLog(url, "r", f"w{w}")
        for h in range(hours):
            for i in range(per_batch):
                ts = T0 + h * 3600 + i * 60 + w * 7
                log.emit("tick", step=h, event_id=f"e/{w}/{h}/{i}")["ts"] = ts
            if w == writers - 1 and w > 0:  # a retry's copy of writer 0's event, later
                log.emit("tick", step=h, event_id=f"e/0/{h}/0")["ts"] = T0 + h * 3600 + 3000
            log.flush()


def test_a_catch_up_holds_a_group_of_batches_at_a_time_not_the_log(tmp_path):
    url = str(tmp_path / "store")
    write_hours(url, hours=40, per_batch=5)
    held, peak, loads = 0, 0, []

    def load(paths: list[str]) -> list[list[dict]]:
        nonlocal held
        loads.append(len(paths))
        batches = load_batches(url, "r", [parse_batch(p) for p in paths])
        held += sum(len(b) for b in batches)
        return batches

    out = []
    for event in sweep(list_batches(url, "r"), load, group=4):
        peak = max(peak, held)
        held -= 1  # yielded: the reader no longer holds it
        out.append(event)
    assert loads == [4] * 10  # 40 batches, 4 at a time
    assert peak <= 4 * 5  # one group's events at most, of a log of 200
    assert out == read_events(url, "r")  # in read_events' order: time, then id


def test_follow_fetches_a_group_at_a_time_and_yields_what_read_events_reads(tmp_path,
                                                                           monkeypatch):
    url = str(tmp_path / "store")
    write_hours(url, hours=12, per_batch=3, writers=3)  # overlapping spans, retried ids
    fetched: list[int] = []
    real_fetch = events_module._fetch

    def counting_fetch(fs, paths):  # the real fetch, counted: what follow asks the store for
        fetched.append(len(paths))
        return real_fetch(fs, paths)

    monkeypatch.setattr(events_module, "_fetch", counting_fetch)
    got = list(follow(url, "r", poll_s=0.01, stop=lambda: True, group=5))
    assert max(fetched) <= 5 and sum(fetched) == 36
    expected = read_events(url, "r")
    assert got == expected  # each id once, the earliest copy (not the retry's), in order
    assert len(got) == 12 * 3 * 3


def test_older_batches_without_a_span_come_first_each_group_in_order(tmp_path):
    url = str(tmp_path / "store")
    write_hours(url, hours=6, per_batch=2)
    fs, root = resolve(url)
    for path in _batches(fs, f"{root}/runs/r/events")[3:]:  # the last three hours: old names
        name = os.path.basename(path)
        os.rename(path, os.path.join(os.path.dirname(path), name.split(".")[0] + ".jsonl"))
    got = [e["event_id"] for e in follow(url, "r", stop=lambda: True, group=2)]
    assert sorted(got) == sorted(e["event_id"] for e in read_events(url, "r"))
    # hours 3-5 (no span in the name) in groups of two, each in order; then hours 0-2
    assert got == ["e/0/3/0", "e/0/3/1", "e/0/4/0", "e/0/4/1", "e/0/5/0", "e/0/5/1",
                   "e/0/0/0", "e/0/0/1", "e/0/1/0", "e/0/1/1", "e/0/2/0", "e/0/2/1"]


def test_a_group_of_no_batches_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="read at least 1"):
        list(sweep([], lambda paths: [], group=0))


def test_a_stream_of_the_log_is_read_events_answer_named_or_not(tmp_path):
    url = str(tmp_path / "store")
    write_hours(url, hours=8, per_batch=3, writers=3)
    assert list(stream_events(url, "r", group=2)) == read_events(url, "r")
    fs, root = resolve(url)
    path = _batches(fs, f"{root}/runs/r/events")[5]  # one batch as older code named it
    os.rename(path, os.path.join(os.path.dirname(path),
                                 os.path.basename(path).split(".")[0] + ".jsonl"))
    assert list(stream_events(url, "r", group=2)) == read_events(url, "r")
