"""benchmarks/spike_forensics.py's pure parts: the planted documents pass data prep's
cleaning filters and land in the train split; the figures' arithmetic on literal runs."""

from __future__ import annotations

import base64
import hashlib
import random
from pathlib import Path

import pytest

from benchmarks.spike_forensics import (
    DATA_MICRO_BATCH_TOKENS,
    KINDS,
    SOUP_TOKENS,
    accuracy,
    diagnoses,
    filter_verdict,
    judge,
    place_faults,
    plant,
    recall_precision,
    rerun_figures,
    run_counts,
    skipped_clean,
    soup_pieces,
    spiked,
)
from dataprep.clean import clean_text, hash_unit
from dataprep.inputs import stdlib_dir
from dataprep.tokens import train_tokenizer
from spec import RunSpec

DATA = RunSpec(run_id="x").data


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE of the benchmark's vocabulary size, trained on stdlib sources as
    the benchmark's clean corpus is."""
    files = sorted(Path(stdlib_dir()).glob("*.py"))[:60]
    return train_tokenizer([f.read_text(errors="replace") for f in files], 2048)


@pytest.mark.parametrize("kind", KINDS)
def test_each_planted_kind_passes_the_cleaning_filters_and_lands_in_train(kind, tok):
    rng = random.Random(3)
    texts = [plant(kind, rng, DATA.val_fraction, tok=tok, pieces=range(256, 2048))
             for _ in range(8)]
    assert len(set(texts)) == len(texts)  # no two alike: exact dedup would drop one
    for text in texts:
        assert filter_verdict(text, DATA.cleaning) is None, (kind, text[:80])
        cleaned = clean_text(text, DATA.cleaning.normalize)[0]
        assert hash_unit(hashlib.sha256(cleaned.encode()).hexdigest()) >= DATA.val_fraction


def test_each_planted_kind_is_what_it_claims():
    rng = random.Random(5)
    assert len(set(plant("rare_run", rng, 0.05))) == 1
    base64.b64decode(plant("base64", rng, 0.05).replace("\n", ""), validate=True)
    bytes.fromhex(plant("hex", rng, 0.05).replace("\n", ""))
    garbled = plant("mojibake", rng, 0.05)
    assert garbled.encode("latin-1").decode("utf-8").isprintable()  # UTF-8 read as Latin-1
    assert not garbled.isascii()


def test_a_token_soup_is_the_corpus_s_word_pieces_sized_to_be_masked(tok):
    rng = random.Random(7)
    soup = plant("token_soup", rng, 0.05, tok=tok, pieces=range(256, 2048))
    lo, hi = SOUP_TOKENS
    # spikes.maskable: a micro-batch keeps a sequence's worth of other tokens
    assert lo <= len(tok.encode(soup).ids) <= hi <= DATA_MICRO_BATCH_TOKENS - 64
    assert soup != plant("token_soup", rng, 0.05, tok=tok, pieces=range(256, 2048))


def test_a_soup_draws_the_rarer_half_of_the_merged_tokens_a_split_holds():
    tokens = [300] * 9 + [301] * 5 + [302] * 2 + [303] + [7] * 50  # 7: a byte, never drawn
    assert soup_pieces(tokens, 400) == [303, 302]


def test_each_planted_run_has_three_soups_and_the_other_kinds_in_turn():
    runs = [run_counts(k) for k in range(5)]
    assert all(r["token_soup"] == 3 and sum(r.values()) == 4 for r in runs)
    others = [next(k for k in r if k != "token_soup") for r in runs]
    assert sorted(set(others)) == sorted(set(KINDS) - {"token_soup"})


def test_a_filter_that_drops_a_document_is_named():
    assert filter_verdict("short", DATA.cleaning) == "dropped_min_chars"
    assert filter_verdict("%$#@!" * 40, DATA.cleaning) is not None


def rollback(step, onset, window, skipped, restored=10):
    return {"kind": "rollback", "event_id": f"rollback/{step}/{onset}/{restored}/a1r2",
            "payload": {"at_step": step, "onset": onset, "window": window, "skipped": skipped}}


def diagnosed(step, onset, verdict, documents=(), restored=10):
    return {"kind": "spike_diagnosed",
            "event_id": f"spike_diagnosed/{step}/{onset}/{restored}/a1r1",
            "payload": {"verdict": verdict, "documents": list(documents), "steps_worth": 6.0,
                        "replay_s": 0.2}}


EVENTS = [diagnosed(103, 101, "data", [7]), rollback(103, 101, [98, 114], "documents"),
          diagnosed(203, 201, "optimisation"), rollback(203, 201, [198, 214], "nothing"),
          diagnosed(303, 301, "unclear"), rollback(303, 301, [298, 314], "window"),
          rollback(403, 401, [398, 414], "window"),  # a NaN spike: no diagnosis
          {"kind": "fault", "event_id": "fault/lr_burst/200", "payload": {}}]


def test_each_rollback_is_paired_with_the_diagnosis_that_decided_it():
    found = diagnoses(EVENTS)
    assert [(f["step"], f["verdict"], f["skipped"]) for f in found] == [
        (103, "data", "documents"), (203, "optimisation", "nothing"), (303, "unclear", "window"),
        (403, "undiagnosed", "window")]
    assert found[0]["documents"] == [7] and found[0]["window"] == [98, 114]


def test_incidents_are_matched_and_scored_per_kind():
    incidents = [{"kind": "data", "document": 7, "cursor": 100, "step": 101},
                 {"kind": "data", "document": 9, "cursor": 300, "step": 301},  # in the window
                 {"kind": "data", "document": 11, "cursor": 900, "step": 901},  # no spike
                 {"kind": "lr_burst", "step": 199},
                 {"kind": "corrupt_grad", "step": 400},
                 {"kind": "corrupt_grad", "step": 500}]
    found = diagnoses(EVENTS)
    judged, stray = judge(incidents, found)
    assert [j["verdict"] for j in judged] == ["data", "unclear", "none", "optimisation",
                                              "undiagnosed", "none"]
    assert stray == []
    acc = accuracy(judged)
    assert acc["data"] == {"incidents": 3, "correct": 1, "accuracy": 0.333, "rolled_back": 2,
                           "accuracy_of_rolled_back": 0.5,
                           "verdicts": {"data": 1, "none": 1, "unclear": 1}}
    assert acc["lr_burst"]["accuracy"] == 1.0
    assert acc["corrupt_grad"] == {"incidents": 2, "correct": 0, "accuracy": 0.0,
                                   "rolled_back": 1, "accuracy_of_rolled_back": 0.0,
                                   "verdicts": {"none": 1, "undiagnosed": 1}}
    _, stray = judge([], found)
    assert len(stray) == 4  # no incident explains them: false diagnoses


def test_recall_and_precision_of_the_planted_documents():
    out = recall_precision({7, 8, 40}, {7, 9}, {7, 9, 11})
    assert out == {"recall": 0.5, "precision": 0.333, "accused": 3, "planted_read": 2}
    assert recall_precision(set(), {7}, {7})["precision"] is None


def test_clean_sequences_skipped_now_and_under_the_whole_window_skip():
    found = diagnoses(EVENTS)
    # 2 rows a cursor; window [98, 114) holds rows 196..227, of which 200 and 201 are dirty
    out = skipped_clean(found, {200, 201}, 2)
    # now: only the `window` rollbacks drop rows (32 each); before: every rollback its window's
    assert out == {"per_incident": round(64 / 4, 2),
                   "old_window_skip_per_incident": round((30 + 32 + 32 + 32) / 4, 2),
                   "rollbacks": 4}


def test_faults_are_placed_apart_in_the_run():
    faults = place_faults(5, 1000, seed=2)
    steps = [f["at_step"] for f in faults]
    assert steps == sorted(steps) and len(steps) == 10
    assert all(b - a >= 60 for a, b in zip(steps, steps[1:]))
    assert [f["kind"] for f in faults].count("corrupt_grad") == 5
    assert all(80 <= s <= 970 for s in steps)


def test_a_planted_document_is_an_incident_only_where_the_detector_called_its_step_an_outlier():
    incidents = [{"kind": "data", "document": 7, "step": 101, "two_steps": False},
                 {"kind": "data", "document": 8, "step": 201, "two_steps": True},
                 {"kind": "data", "document": 9, "step": 301, "two_steps": False}]
    events = [{"kind": "loss_spike", "step": 101}, {"kind": "loss_spike", "step": 202},
              {"kind": "loss_spike", "step": 302}]  # 302: not a step that read document 9
    assert [i["spiked"] for i in spiked(incidents, events)] == [True, True, False]


def test_the_second_run_counts_its_outliers_where_planted_documents_were_left_in():
    first = {"evals": {100: 4.0}, "events": []}
    rerun = {"evals": {100: 3.9}, "events": [{"kind": "loss_spike", "step": 40},
                                             {"kind": "loss_spike", "step": 77}]}
    out = rerun_figures(rerun, first, {3: "hex"}, {77, 78}, dropped=5)
    assert out["outliers"] == 2 and out["outliers_at_planted_left"] == [77]
    assert out["quarantine_dropped"] == 5 and out["planted_left"] == 1
    assert out["final_val_loss_ratio_vs_first"] == {"step": 100, "ratio": 0.975}
