"""Event log (DESIGN §3): immutable batches, idempotent event_ids, merge + dedupe + order,
follow; two concurrent writer processes with retries, on file:// and SeaweedFS s3://."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading

import pytest

from storage.events import EventLog, _batches, _load, follow, merge, read_events
from storage.fs import resolve
from tests.storage.ckpt_helpers import BACKENDS, durable_url

WRITER = """
import sys
from storage.events import EventLog
url, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for attempt in (1, 2):  # attempt 2 is an activity retry: it re-emits the same event_ids
    log = EventLog(url, "r", name, attempt=attempt)
    for i in range(n if attempt == 1 else n // 2):
        log.emit("tick", step=i, event_id=f"{name}/{i}", writer_seq=i)
        log.emit("checkpoint_committed", step=i, event_id=f"checkpoint_committed/{i}")
        if i % 7 == 6:
            log.flush()
    log.flush()
"""

CRASHER = """
import sys, time
from storage.events import EventLog
log = EventLog(sys.argv[1], "r", "crasher")
for i in range(3):
    log.emit("tick", event_id=f"flushed/{i}")
log.flush()
for i in range(3):
    log.emit("tick", event_id=f"unflushed/{i}")
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path):
    return durable_url(request.param, tmp_path, request)


def spawn(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()}, **kw)


@pytest.mark.process
def test_two_writer_processes_with_retries_merge_without_duplicates_in_a_stable_order(
        url, tmp_path):
    n = 40
    procs = [spawn(WRITER, url, name, str(n)) for name in ("alpha", "beta")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    events = read_events(url, "r")
    ids = [e["event_id"] for e in events]
    expected = {f"{w}/{i}" for w in ("alpha", "beta") for i in range(n)}
    expected |= {f"checkpoint_committed/{i}" for i in range(n)}
    assert len(ids) == len(set(ids)) and set(ids) == expected
    assert [(e["ts"], e["event_id"]) for e in events] == sorted((e["ts"], e["event_id"])
                                                                for e in events)
    # Retried copies lose to the first attempt's, whatever order the batches are listed in.
    assert all(e["attempt"] == 1 for e in events)
    fs, root = resolve(url)
    batches = [_load(fs, p) for p in _batches(fs, f"{root}/runs/r/events")]
    assert len(batches) > 4  # several immutable objects per writer, none rewritten
    for seed in range(3):
        random.Random(seed).shuffle(batches)
        assert merge(batches) == events
    assert read_events(url, "r") == events
    cache = str(tmp_path / "cache")
    assert read_events(url, "r", cache_dir=cache) == events  # fetched, and kept
    assert sorted(os.listdir(cache)) == sorted(os.path.basename(p)
                                               for p in _batches(fs, f"{root}/runs/r/events"))
    assert read_events(url, "r", cache_dir=cache) == events  # read back from the copies


def test_a_cached_batch_is_read_from_the_cache_and_a_new_one_from_the_store(url, tmp_path):
    log = EventLog(url, "r", "w")
    log.emit("tick", event_id="a", n=1)
    log.flush()
    cache = str(tmp_path / "cache")
    assert [e["payload"]["n"] for e in read_events(url, "r", cache_dir=cache)] == [1]
    (name,) = os.listdir(cache)
    # batches are immutable: the cached copy is what a reader gets, whatever the store says
    # (here a copy edited by hand stands for it, to prove which one was read)
    with open(os.path.join(cache, name), "rb") as f:
        kept = f.read()
    with open(os.path.join(cache, name), "wb") as f:
        f.write(kept.replace(b'"n": 1', b'"n": 7'))
    log.emit("tick", event_id="b", n=2)
    log.flush()
    assert [e["payload"]["n"] for e in read_events(url, "r", cache_dir=cache)] == [7, 2]
    assert [e["payload"]["n"] for e in read_events(url, "r")] == [1, 2]
    assert len(os.listdir(cache)) == 2


@pytest.mark.process
def test_a_sigkilled_writer_loses_only_its_unflushed_batch(url):
    child = spawn(CRASHER, url, stdout=subprocess.PIPE)
    for line in child.stdout:  # structlog shares stdout
        if line.strip() == "ready":
            break
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert [e["event_id"] for e in read_events(url, "r")] == [f"flushed/{i}" for i in range(3)]


def test_follow_yields_each_event_once_as_batches_arrive(url):
    first, retry = EventLog(url, "r", "w"), EventLog(url, "r", "w", attempt=2)
    got: list[str] = []
    done = threading.Event()

    def produce() -> None:
        for batch in range(3):
            for i in range(2):
                first.emit("tick", event_id=f"e{batch}{i}")
            first.flush()
        retry.emit("tick", event_id="e00")  # a retried duplicate: never yielded twice
        retry.flush()
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    for event in follow(url, "r", poll_s=0.05, stop=done.is_set):
        got.append(event["event_id"])
    producer.join()
    assert sorted(got) == sorted(f"e{b}{i}" for b in range(3) for i in range(2))


def test_a_payload_may_carry_any_key_the_envelope_uses(tmp_path):
    # a fault's payload has a `kind` of its own; a workflow's (record_event) can carry
    # `step` or `event_id`: the mapping form takes any key, keyword fields merge over it
    url = str(tmp_path / "store")
    with EventLog(url, "r", "t") as log:
        log.emit("fault", step=33, event_id="f/33", kind="kill_worker", payload="p")
        log.emit("stage_finished", {"stage": "promote", "step": 40, "event_id": "x"},
                 step=41, event_id="stage_finished/promote", uri="u")
        log.emit("tick", {"a": 1, "b": 1}, b=2)
    got = {e["event_id"]: (e["kind"], e["step"], e["payload"]) for e in read_events(url, "r")}
    assert got["f/33"] == ("fault", 33, {"kind": "kill_worker", "payload": "p"})
    assert got["stage_finished/promote"] == (
        "stage_finished", 41, {"stage": "promote", "step": 40, "event_id": "x", "uri": "u"})
    (tick,) = [v for v in got.values() if v[0] == "tick"]
    assert tick == ("tick", None, {"a": 1, "b": 2})
