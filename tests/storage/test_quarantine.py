"""A run's quarantine: derived from its `spike_diagnosed` events (pure), written whole to
runs/<run_id>/quarantine.jsonl by the promote activity (file:// and real SeaweedFS S3),
read back by data prep with errors that name the file."""

from __future__ import annotations

import json
import os

import pytest
from temporalio.testing import ActivityEnvironment

from activities.contracts import PromoteInput
from activities.data import promote
from common.errors import BadData
from spec import RunSpec
from storage.checkpoints import CheckpointStore
from storage.events import EventLog
from storage.fs import resolve
from storage.quarantine import (
    QUARANTINE,
    quarantine_entries,
    quarantine_key,
    quarantine_uri,
    quarantined_hashes,
    read_quarantine,
    write_quarantine,
)
from tests.storage.ckpt_helpers import BACKENDS, durable_url, payload, write_files

RUN = "r"
H1, H2, H3 = "a1" * 16, "b2" * 16, "c3" * 16


def source(document: int, sha: str, record: int = 3) -> dict:
    return {"document": document, "source": "file:///corpus/a.jsonl", "record": record,
            "sha256": sha, "chars": 120 + document}


def diagnosed(step: int, verdict: str, sources: list[dict], outliers: list[dict] | None = None,
              event_id: str = "") -> dict:
    """A `spike_diagnosed` event as trainer/guard.py writes it."""
    return {"event_id": event_id or f"spike_diagnosed/{step}/{step - 2}/{step - 10}/a1r1",
            "run_id": RUN, "kind": "spike_diagnosed", "ts": float(step), "step": step,
            "payload": {"verdict": verdict, "documents": [s["document"] for s in sources],
                        "outliers": outliers or [], "sources": sources}}


def test_each_guilty_text_is_quarantined_once_with_the_first_diagnosis_evidence():
    events = [
        diagnosed(40, "data", [source(7, H1), source(9, H2)],
                  [{"document": 7, "loss": 9.5, "z": 12.25}, {"document": 9, "loss": 8.0, "z": 7.5}]),
        # the same text again, under another document number, in a later spike
        diagnosed(90, "data", [source(31, H1.upper()), source(33, H3, record=-1)],
                  [{"document": 31, "loss": 7.0, "z": 6.5}, {"document": 33, "loss": 9.9, "z": 20.0}]),
    ]
    got = quarantine_entries(events)
    assert [e.sha256 for e in got] == [H1, H2, H3]
    first = got[0]
    assert (first.run_id, first.source, first.record, first.chars, first.document) == \
        (RUN, "file:///corpus/a.jsonl", 3, 127, 7)
    assert (first.step, first.z, first.loss, first.verdict) == (40, 12.25, 9.5, "data")
    assert first.event_id == events[0]["event_id"]
    assert (got[2].record, got[2].step, got[2].z, got[2].event_id) == \
        (-1, 90, 20.0, events[1]["event_id"])


def test_verdicts_other_than_data_and_accusations_without_a_hash_quarantine_nothing():
    events = [
        diagnosed(10, "numerics", [source(1, H1)]),
        diagnosed(20, "optimisation", [source(2, H2)]),
        diagnosed(30, "unclear", [source(3, H3)]),
        diagnosed(40, "data", []),  # named by batch cursor: no document, no record
        diagnosed(50, "data", [{"document": 4, "source": "x", "record": 1}]),  # no index
        diagnosed(60, "data", [source(5, "not-hex" * 6)]),
        {"event_id": "rollback/60", "run_id": RUN, "kind": "rollback", "ts": 61.0, "step": 60,
         "payload": {"verdict": "data", "sources": [source(6, H1)]}},
    ]
    assert quarantine_entries(events) == []


def test_the_key_is_the_set_of_hashes_not_their_order_or_repeats():
    assert quarantine_key([H1, H2]) == quarantine_key([H2, H1, H2])
    assert quarantine_key([H1]) != quarantine_key([H1, H2])


@pytest.fixture(params=BACKENDS)
def url(request, tmp_path) -> str:
    return durable_url(request.param, tmp_path, request)


def _emit(url: str, *events: dict) -> None:
    with EventLog(url, RUN, "trainer") as log:
        for e in events:
            log.emit(e["kind"], e["payload"], step=e["step"], event_id=e["event_id"])


def test_the_file_is_the_derivation_of_the_log_rewritten_whole_and_idempotently(url):
    _emit(url, diagnosed(40, "data", [source(7, H1)], [{"document": 7, "loss": 9.5, "z": 12.0}]))
    uri, n = write_quarantine(url, RUN)
    assert n == 1 and uri == quarantine_uri(url, RUN) and uri.endswith(f"runs/{RUN}/{QUARANTINE}")
    fs, path = resolve(uri)
    before = fs.cat_file(path)
    assert write_quarantine(url, RUN) == (uri, 1) and fs.cat_file(path) == before  # same bytes
    _emit(url, diagnosed(90, "data", [source(31, H2), source(8, H1)]))
    assert write_quarantine(url, RUN)[1] == 2
    lines = [json.loads(line) for line in fs.cat_file(path).decode().splitlines()]
    assert [(d["sha256"], d["step"], d["z"]) for d in lines] == [(H1, 40, 12.0), (H2, 90, None)]
    assert [e.sha256 for e in read_quarantine(uri)] == [H1, H2]
    if uri.startswith("file://"):  # replaced by rename: no temporary file is left beside it
        assert sorted(os.listdir(os.path.dirname(path))) == ["events", QUARANTINE]


def test_the_promote_activity_writes_the_run_s_quarantine(tmp_path):
    url = str(tmp_path / "durable")
    CheckpointStore(url, RUN).commit(4, write_files(tmp_path / "s4", payload(4)))
    _emit(url, diagnosed(40, "data", [source(7, H1)], [{"document": 7, "loss": 9.5, "z": 12.0}]),
          diagnosed(41, "optimisation", [source(8, H2)]))
    spec = RunSpec.from_dict({"run_id": RUN, "storage": {"durable": url}})
    ActivityEnvironment().run(promote, PromoteInput(spec.to_dict(), 4))
    (entry,) = read_quarantine(quarantine_uri(url, RUN))
    assert (entry.sha256, entry.step, entry.z) == (H1, 40, 12.0)


def test_a_run_without_a_data_diagnosis_gets_an_empty_quarantine_file(tmp_path):
    url = str(tmp_path / "durable")
    _emit(url, diagnosed(41, "optimisation", [source(8, H2)]))
    uri, n = write_quarantine(url, RUN)
    assert n == 0 and read_quarantine(uri) == [] and quarantined_hashes([uri]) == frozenset()


def test_a_missing_or_malformed_quarantine_file_is_bad_data_naming_it(tmp_path):
    missing = str(tmp_path / "nowhere" / QUARANTINE)
    with pytest.raises(BadData) as err:
        quarantined_hashes([missing])
    assert err.value.path == missing and "cannot read quarantine file" in str(err.value)
    assert not err.value.retryable
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"sha256": H1}) + "\n" + json.dumps({"sha256": "xyz"}) + "\n")
    with pytest.raises(BadData) as err:
        read_quarantine(str(bad))
    assert err.value.path == f"{bad}:2" and "not a quarantine entry" in str(err.value)


def test_a_hand_written_line_needs_only_a_hash_and_a_full_digest_is_cut_to_the_index_s(
        tmp_path):
    full = "D4" * 32  # a whole sha256, upper case
    path = tmp_path / "hand.jsonl"
    path.write_text(json.dumps({"sha256": full}) + "\n\n")
    (entry,) = read_quarantine(str(path))
    assert (entry.sha256, entry.record, entry.step, entry.z) == ("d4" * 16, -1, None, None)


def test_a_segment_that_rolled_back_updates_the_quarantine_and_a_failure_costs_it_nothing(
        tmp_path):
    from activities.training import update_quarantine

    url = str(tmp_path / "durable")
    _emit(url, diagnosed(40, "data", [source(7, H1)], [{"document": 7, "loss": 9.5, "z": 12.0}]))
    spec = RunSpec.from_dict({"run_id": RUN, "storage": {"durable": url,
                                                         "fast": str(tmp_path / "fast")}})
    update_quarantine(spec)
    assert [e.sha256 for e in read_quarantine(quarantine_uri(url, RUN))] == [H1]
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the store's directory should be")
    update_quarantine(RunSpec.from_dict({"run_id": RUN, "storage": {
        "durable": str(blocked), "fast": str(tmp_path / "fast")}}))  # logged, not raised
