"""Event batch names (storage/event_batches.py): each says the span of its events' times and
whether it holds a MARKED kind, so a reader of a window or of incidents fetches only the
batches it needs; a name that says nothing (older code's, or one that does not parse) is
read by every reader, never an error."""

from __future__ import annotations

import ast
import json
import math
import os

import pytest

from storage.event_batches import MARKED_KINDS, Batch, batch_name, parse_batch, select
from storage.events import EventLog, _batches, list_batches, read_events
from storage.fs import resolve
from tests.storage.ckpt_helpers import BACKENDS, durable_url

T0 = 1_700_000_000.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ev(kind: str, ts: float) -> dict:
    return {"kind": kind, "ts": ts}


def test_a_batch_is_named_with_its_span_in_milliseconds_and_marked_when_it_holds_an_incident():
    assert batch_name("w-1-ab-000003", [ev("train_metrics", 2.0005), ev("tick", 1.5)]) \
        == "w-1-ab-000003.1500-2001.jsonl"
    assert batch_name("w-000004", [ev("train_metrics", 1.0), ev("fault", 2.0)]) \
        == "w-000004.1000-2000.m.jsonl"
    parsed = parse_batch("/s/runs/r/events/w-000004.1000-2000.m.jsonl")
    # a millisecond either side: a float time times 1000 can round onto the next one
    assert (parsed.first, parsed.last, parsed.marked) == (0.999, 2.001, True)
    assert parse_batch("w-1-ab-000003.1500-2001.jsonl").marked is False


def test_times_a_name_cannot_hold_give_the_old_name_that_every_reader_reads():
    for times in ([math.nan], [math.inf, 1.0], [-1.0], [1e14], []):
        assert batch_name("w-000001", [ev("fault", t) for t in times]) == "w-000001.jsonl"


@pytest.mark.parametrize("name", [
    "workflow-123-abcdef12-000001.jsonl",  # older code's: no span
    "workflow-123-12345678-000001.jsonl",  # an all-digit random part is still no span
    "w.2000-1000.jsonl",  # a span that runs backwards
    "w.12345678901234567-1.jsonl",  # more digits than a time in range has
    "w.1000--2000.jsonl", "w.-1000-2000.jsonl", "w.1e3-2e3.jsonl", "w.0x10-0x20.jsonl",
    "w.\u0661\u0662-\u0663\u0664.jsonl",  # digits, but not ASCII ones
    "w.1000-2000.M.jsonl", "w.1000-2000.mm.jsonl", "w.1000-2000.jsonl.tmp",
    "w.1000-2000.jsonl\n", ".jsonl", "", "1000-2000.jsonl", "x" * 100_000 + ".1-2",
])
def test_a_name_that_does_not_parse_says_nothing(name):
    assert parse_batch(f"/s/{name}") == Batch(f"/s/{name}")


def test_a_window_fetches_the_batches_it_meets_and_every_one_that_says_nothing():
    batches = [parse_batch(n) for n in (
        "a.1000-2000.jsonl", "b.2500-3000.m.jsonl", "c.5000-9000.jsonl", "old-000001.jsonl")]
    names = lambda chosen: [b.path.split(".")[0] for b in chosen]  # noqa: E731
    assert names(select(batches, since=2.2, until=4.0)) == ["b", "old-000001"]
    assert names(select(batches, since=9.5)) == ["old-000001"]
    assert names(select(batches, until=1.5)) == ["a", "old-000001"]
    assert names(select(batches)) == ["a", "b", "c", "old-000001"]
    # kinds that are all MARKED: only marked batches (and those that say nothing)
    assert names(select(batches, kinds=("fault", "recovered"))) == ["b", "old-000001"]
    # one kind that is not: a mark cannot rule anything out
    assert names(select(batches, kinds=("fault", "train_metrics"))) == ["a", "b", "c",
                                                                        "old-000001"]


def write_run(url: str, hours: int) -> None:
    """A run of `hours` batches an hour apart, one writer each, a fault at hour 2."""
    for h in range(hours):
        log = EventLog(url, "r", f"w{h}")
        for i in range(3):
            log.emit("train_metrics", step=h * 3 + i, event_id=f"m/{h}/{i}")["ts"] = \
                T0 + h * 3600 + i
        if h == 2:
            log.emit("fault", step=7, event_id="fault/2", kind="hang")["ts"] = T0 + 2 * 3600 + 1.5
        log.flush()


def as_old(url: str, keep: int) -> None:
    """Rename the first `keep` batches as older code named them: `<writer>-<seq>.jsonl`."""
    fs, root = resolve(url)
    for path in _batches(fs, f"{root}/runs/r/events")[:keep]:
        name = os.path.basename(path)
        os.rename(path, os.path.join(os.path.dirname(path), name.split(".")[0] + ".jsonl"))


def test_a_window_read_fetches_only_the_batches_it_needs_and_old_ones(tmp_path):
    url = str(tmp_path / "store")
    write_run(url, 6)
    as_old(url, 1)  # w0's batch: named by older code
    cache = str(tmp_path / "cache")  # a fetched batch is kept here: what was fetched
    got = read_events(url, "r", since=T0 + 3 * 3600, until=T0 + 4 * 3600 + 1, cache_dir=cache)
    assert [e["event_id"] for e in got] == ["m/3/0", "m/3/1", "m/3/2", "m/4/0", "m/4/1"]
    fetched = sorted(n.split("-")[0] for n in os.listdir(cache))
    assert fetched == ["w0", "w3", "w4"]  # w0 says nothing of its span: read, its events out
    assert [e["event_id"] for e in read_events(url, "r", ("fault",))] == ["fault/2"]
    assert read_events(url, "r", since=T0 - 10, until=T0 + 1) == [
        e for e in read_events(url, "r") if e["ts"] <= T0 + 1]  # the old batch's events


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_store_lists_the_names_a_window_read_chooses_from(backend, tmp_path, request):
    url = durable_url(backend, tmp_path, request)  # a local directory, real SeaweedFS S3
    write_run(url, 4)
    cache = str(tmp_path / "cache")
    got = read_events(url, "r", since=T0 + 2 * 3600, until=T0 + 2 * 3600 + 1.5,
                      cache_dir=cache)
    assert [e["event_id"] for e in got] == ["m/2/0", "m/2/1", "fault/2"]
    assert [n.split("-")[0] for n in os.listdir(cache)] == ["w2"]
    assert [b.marked for b in list_batches(url, "r")] == [False, False, True, False]


def test_a_read_of_marked_kinds_fetches_only_marked_batches(tmp_path):
    url = str(tmp_path / "store")
    write_run(url, 5)
    as_old(url, 1)
    cache = str(tmp_path / "cache")
    got = read_events(url, "r", ("fault", "run_finished"), cache_dir=cache)
    assert [e["event_id"] for e in got] == ["fault/2"]
    assert sorted(n.split("-")[0] for n in os.listdir(cache)) == ["w0", "w2"]
    assert [b.marked for b in list_batches(url, "r")] == [None, False, True, False, False]


def test_an_old_run_reads_as_it_did(tmp_path):
    url = str(tmp_path / "store")
    write_run(url, 4)
    everything = read_events(url, "r")
    as_old(url, 4)
    assert all(b.first is None for b in list_batches(url, "r"))
    assert read_events(url, "r") == everything
    assert read_events(url, "r", ("fault",)) == [e for e in everything if e["kind"] == "fault"]
    assert read_events(url, "r", since=T0 + 3600, until=T0 + 3601) == everything[3:5]


def test_readers_that_look_for_rare_kinds_across_a_run_read_marked_kinds_only():
    from ops.explain import TOLD_KINDS

    assert set(TOLD_KINDS) <= MARKED_KINDS
    # what a trainer's start-up reads, taken from its source (importing it imports torch)
    tree = ast.parse(open(os.path.join(ROOT, "trainer", "segment.py")).read())
    (startup,) = [ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.Assign) and ast.unparse(node.targets[0])
                  == "STARTUP_EVENTS"]
    assert set(startup) <= MARKED_KINDS
    assert {"fault", "recovered"} <= MARKED_KINDS  # the supervisor's (activities/recovery.py)


def test_a_log_of_hostile_names_is_read_whole_by_every_reader(tmp_path):
    from ops.explain import explain
    from storage.events import follow, stream_events

    url = str(tmp_path / "store")
    directory = tmp_path / "store" / "runs" / "r" / "events"
    directory.mkdir(parents=True)
    names = ["workflow-123-12345678-000001.jsonl", "w.2000-1000.jsonl",
             "w.12345678901234567-1.jsonl", "w.1e3-2e3.jsonl", "w.\u0661-\u0662.jsonl",
             "w.1000-2000.mm.jsonl", ".jsonl", "w.0-0.m.jsonl"]
    for i, name in enumerate(names):
        line = {"event_id": f"f{i}", "kind": "fault", "ts": T0 + i, "step": i,
                "payload": {"kind": "hang"}, "run_id": "r", "writer": "x"}
        (directory / name).write_text(json.dumps(line) + "\n")
    every = [f"f{i}" for i in range(len(names))]
    # the last name parses, and lies: its span [0, 0] ms does not hold its event's time
    assert [e["event_id"] for e in read_events(url, "r")] == every
    assert sorted(e["event_id"] for e in follow(url, "r", stop=lambda: True)) == every
    assert sorted(e["event_id"] for e in stream_events(url, "r")) == every
    assert [e["event_id"] for e in read_events(url, "r", ("fault",))] == every
    assert len(explain(url, "r")) == len(names)
