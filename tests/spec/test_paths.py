"""spec/paths.py: a spec's relative paths anchored at one root, and
spec/summary.py: the static summary a starter gives the Web UI."""

from __future__ import annotations

import pytest

from common.errors import BadConfig
from spec import RunSpec
from spec.paths import anchor, anchor_raw, needs_root, unanchored
from spec.summary import static_details, static_summary
from storage.fs import normalize_url
from tests.spec.helpers import pinned


def relative_everywhere() -> RunSpec:
    return pinned(run_id="r", faults=[{"kind": "crash", "at_step": 3, "path": "flag"}],
                  **{"data.corpus": "corpus/*.jsonl", "data.tokenizer.path": "tok/t.json",
                     "storage.durable": "out/../store", "storage.fast": "./fast"})


def test_every_relative_path_is_anchored_under_the_root_and_nothing_else_moves():
    s = relative_everywhere()
    assert unanchored(s) == ["storage.durable", "storage.fast", "data.corpus",
                             "data.tokenizer.path", "faults[0].path"]
    assert needs_root(s)
    a = anchor(s, "/srv/runs")
    assert a.storage.durable == "file:///srv/runs/store"  # a bare durable path is a file:// URL
    assert a.storage.fast == "/srv/runs/fast"
    assert a.data.corpus == "/srv/runs/corpus/*.jsonl"  # globs stay globs
    assert a.data.tokenizer.path == "/srv/runs/tok/t.json"
    assert a.faults[0].path == "/srv/runs/flag"
    assert unanchored(a) == [] and anchor(a, "/elsewhere") == a  # once is enough
    assert a.replace(**{"storage.durable": s.storage.durable, "storage.fast": s.storage.fast,
                        "data.corpus": s.data.corpus, "data.tokenizer.path": "tok/t.json",
                        "faults": [{"kind": "crash", "at_step": 3, "path": "flag"}]}) == s


def test_urls_stdlib_corpora_and_empty_paths_are_left_as_written():
    s = pinned(run_id="r", **{"storage.durable": "s3://bucket/prefix",
                                      "storage.fast": "/nvme/fast", "data.corpus": "stdlib:*.py"})
    assert unanchored(s) == [] and not needs_root(s) and anchor(s, "/srv") is s
    memory = s.replace(**{"data.corpus": "memory://c/*.txt", "storage.durable": "memory://x"})
    assert anchor(memory, "/srv") is memory


def test_a_spec_anchored_by_either_client_has_one_hash():
    """`mainspring run start` used storage/fs.py:normalize_url and abspath; the workflow's
    anchoring must give the same spec, so a run started one way resumes the other way."""
    for durable, fast in (("store", "fast"), ("/abs/store/", "/abs//fast/"),
                          ("s3://bucket/prefix/", "f")):
        s = pinned(run_id="r", **{"storage.durable": durable, "storage.fast": fast})
        a = anchor(s, "/work/dir")
        old = normalize_url(durable) if "://" in durable or durable.startswith("/") \
            else "file:///work/dir/" + durable
        assert a.storage.durable == old
        assert a.storage.fast == (fast.rstrip("/").replace("//", "/") if fast.startswith("/")
                                  else "/work/dir/" + fast)
        assert anchor(a, "/other").spec_hash() == a.spec_hash()


def test_the_raw_spec_keeps_what_was_written_and_gains_only_the_anchored_paths():
    raw = {"run_id": "r", "train": {"total_steps": 20, "segment_steps": 10,
                                    "checkpoint_every": 5, "warmup_steps": 2},
           "faults": [{"kind": "crash", "at_step": 3, "path": "flag"}]}
    s = RunSpec.from_dict(raw)
    out = anchor_raw(raw, s, "/root")
    assert out == {**raw, "faults": [{"kind": "crash", "at_step": 3, "path": "/root/flag"}],
                   "storage": {"durable": "file:///root/.mainspring/store",
                               "fast": "/root/.mainspring/fast"}}  # the defaults, anchored
    assert RunSpec.from_dict(out) == anchor(s, "/root")
    assert raw["faults"][0]["path"] == "flag"  # not changed in place


def test_a_home_path_is_expanded_by_a_client_and_refused_without_a_home():
    s = pinned(run_id="r", **{"storage.durable": "~/store", "storage.fast": "~/fast"})
    assert unanchored(s) == ["storage.durable", "storage.fast"]
    with pytest.raises(BadConfig) as refused:
        anchor(s, "/srv")
    assert refused.value.field == "storage.durable"
    assert "home directory of whichever process reads it" in refused.value.problem
    assert "absolute path" in refused.value.fix and "mainspring run start" in refused.value.fix
    a = anchor(s, "/srv", home="/home/ann")
    assert (a.storage.durable, a.storage.fast) == ("file:///home/ann/store", "/home/ann/fast")
    with pytest.raises(BadConfig):  # another user's home is not this process's to guess
        anchor(s.replace(**{"storage.durable": "~bob/x"}), "/srv", home="/home/ann")


def test_the_root_must_be_absolute():
    with pytest.raises(ValueError):
        anchor(relative_everywhere(), "relative/root")


def test_the_static_summary_names_the_run_its_size_and_where_its_record_is():
    s = anchor(pinned(run_id="my-run"), "/srv")
    assert static_summary(s) == \
        "my-run: 160 steps of a 2×128 GPT on stdlib:*.py, sweep 2×15 steps"
    assert static_summary(s.replace(**{"sweep.enabled": False})) == \
        "my-run: 160 steps of a 2×128 GPT on stdlib:*.py"
    details = static_details(s)
    assert s.spec_hash() in details and "file:///srv/.mainspring/store" in details
    assert "temporal workflow query --workflow-id my-run --type status" in details
    assert "layout:" not in details
    planned = static_details(s.replace(**{"train.layout": "auto"}))
    assert "layout: TP 1 × PP 1, ZeRO 0 — planned: TP 1: the bf16 weights" in planned
