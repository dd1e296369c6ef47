"""Every reader of JSON from the store, fed hostile records (huge, NaN and infinite numbers,
numbers of thousands of digits, wrong types in every field, nesting 10^5 deep, control
characters, `../` ids, foreign URLs, oversized bytes): each call returns, or raises only
the reader's own documented error, within a bounded time, and opens nothing outside the
store. Local stores (the readers' code path is the same on S3: fs.cat_file)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings

from common.errors import BadData
from common.store_json import MAX_RECORD_BYTES
from storage.checkpoints import CheckpointStore, CorruptCheckpoint
from storage.dataset import load_manifest
from storage.events import read_events
from storage.quarantine import read_quarantine
from storage.rollback import pinned_steps, read_branches
from storage.runs import claim_owner, stored_spec
from storage.scrub import read_record
from storage.spans import read_spans
from tests.storage.hostile import FRAGMENTS, confined, records, splice

RUN = "r"
SHA = "ab" * 32
WITHIN_S = 2.0  # per call, on a loaded 2-core machine; a decoder that recurses or a
#                 5,000-digit int() would take far longer or raise
EXAMPLES = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
def _put(root: str, rel: str, data: bytes) -> str:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


# ---- one entry per reader: (where the record goes, a valid template, the call) ---------
def _lineage(root):
    branches = read_branches(CheckpointStore(root, RUN))
    assert all(b.lineage >= 1 and b.restored_step >= 0 for b in branches)
    return branches


def _pins(root):
    steps = pinned_steps(CheckpointStore(root, RUN))
    assert all(isinstance(s, int) for s in steps)
    return steps


def _spec(root):
    spec = stored_spec(root, RUN)
    assert spec is None or isinstance(spec, dict)
    return spec is not None


def _claim(root):
    with _only(BadData):
        kind, spec_hash = claim_owner(root, RUN)
        assert kind == "claim" and isinstance(spec_hash, str)
        return spec_hash


def _quarantine(root):
    with _only(BadData):
        entries = read_quarantine(os.path.join(root, "runs", RUN, "quarantine.jsonl"))
        assert all(len(entry.sha256) >= 16 for entry in entries)
        return entries


def _spans(root):
    spans = read_spans(root, RUN)
    assert all(isinstance(s["start_ns"], int) and isinstance(s["span_id"], str) for s in spans)
    return spans


def _scrub(root):
    record = read_record(CheckpointStore(root, RUN))
    for steps in record.values():
        assert all(isinstance(s, int) and isinstance(d, str) and isinstance(at, float)
                   for s, (d, at) in steps.items())
    return record


def _events(root):
    events = [e for e in read_events(root, RUN) if e["kind"] != "event_log_damaged"]
    assert all(isinstance(e["ts"], (int, float)) for e in events)
    return events


def _manifest(root):
    store = CheckpointStore(root, RUN)
    with _only(CorruptCheckpoint):
        store.manifest(5)
    man = store.committed_manifest(5)
    assert man is None or man.step == 5
    return man


def _part(root):
    parts = CheckpointStore(root, RUN).parts(5, "s1", 2)
    assert set(parts) <= {1}
    return parts


def _dataset(root):
    with _only(BadData):
        return load_manifest(os.path.join(root, "datasets", "h", "MANIFEST.json"))


class _only:
    """Within it, an exception is allowed only if it is `kind` (the reader's documented one)."""

    def __init__(self, kind):
        self.kind = kind

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        return typ is not None and issubclass(typ, self.kind)


READERS = {
    "lineage": (f"runs/{RUN}/lineage/000000001.json",
                {"lineage": 1, "restored_step": 5, "abandoned": [6, 7]}, _lineage),
    "pin": (f"runs/{RUN}/pins/p.json", {"to_step": 5}, _pins),
    "stored_spec": (f"runs/{RUN}/RUN.json", {"run_id": RUN, "spec_hash": "h", "spec": {}},
                    _spec),
    "claim": (f"runs/{RUN}/RUN.json", {"run_id": RUN, "spec_hash": "h", "spec": {}}, _claim),
    "quarantine": (f"runs/{RUN}/quarantine.jsonl", {"sha256": SHA, "record": 1, "z": 1.5},
                   _quarantine),
    "spans": (f"runs/{RUN}/spans/w-0.jsonl", {"span_id": "s", "start_ns": 1, "name": "n"},
              _spans),
    "scrub": (f"runs/{RUN}/scrub.json", {"verified": {"": {"5": {"manifest": "d", "at": 1.0}}}},
              _scrub),
    "events": (f"runs/{RUN}/events/w-000001.jsonl",
               {"event_id": "e", "kind": "k", "ts": 1.0, "step": 1, "payload": {}}, _events),
    "manifest": (f"runs/{RUN}/checkpoints/step-000000005/MANIFEST.json",
                 {"step": 5, "files": {}, "tokens_seen": 1, "extra": {"lineage": 0}}, _manifest),
    "part": (f"runs/{RUN}/checkpoints/step-000000005/parts/node-1.json",
             {"step": 5, "node_rank": 1, "session": "s1", "created": 1.0, "files": {}}, _part),
    "dataset": ("datasets/h/MANIFEST.json",
                {"content_hash": "h", "vocab_size": 10, "eos_id": 0, "dtype": "uint16",
                 "shards": []}, _dataset),
}


def _check(name: str, record: bytes) -> object:
    rel, _, call = READERS[name]
    with tempfile.TemporaryDirectory(prefix="hostile-") as root:
        _put(root, rel, record)
        with confined(root, WITHIN_S):
            return call(root)


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_store_reader_takes_its_valid_record(name):
    assert _check(name, json.dumps(READERS[name][1]).encode())  # read, not refused


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_store_reader_survives_every_known_hostile_value_in_every_field(name):
    template = READERS[name][1]
    for key in [None, *template, "unexpected"]:
        for fragment in FRAGMENTS:
            _check(name, splice(template, key, fragment))


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_store_reader_survives_hostile_records_within_bounds(name):
    @EXAMPLES
    @given(record=records(READERS[name][1]))
    def check(record: bytes) -> None:
        _check(name, record)

    check()


@pytest.mark.parametrize("name", sorted(READERS))
def test_each_store_reader_refuses_an_oversized_record_quickly(name):
    _check(name, b'{"pad": "' + b"A" * (MAX_RECORD_BYTES + 1) + b'"}')
