"""Spike forensics: how well a spike's diagnosis (trainer/diagnosis.py) tells causes apart.

    .venv/bin/python benchmarks/spike_forensics.py [--quick] [--steps 5000] [--incidents 10]
                                                   [--seed 1] [--world 2] [--jobs 2]
                                                   [--workdir DIR]

Corpus: this Python's standard-library top-level sources, as `benchmarks/spikes.py` uses
them, copied into a directory with planted bad documents beside them: token soups (the
corpus's rarer word pieces in random order, ~1,900 tokens: garbled text, as a broken
extractor or a spam page leaves it), runs of one rare character, base64 blobs, hex blobs
and mojibake (UTF-8 read as Latin-1), each of which passes data prep's cleaning filters (checked here: a kind a filter drops is reported in
`planted`, never counted) and is drawn until its hash puts it in the train split. Both
corpora go through the real data prep (`prepare_dataset`: cleaning, dedup, the provenance
index); the planted one reuses the clean one's tokenizer, so both have the same held-out
tokens and their held-out losses compare.

Runs (the real `trainer.segment` under torchrun, `benchmarks/spikes.py`'s `run` and
`spec_for`; `--world` ranks each, DeepSpeed ZeRO 0 on gloo). A diagnosis runs on a
rollback, and at the default `spikes.patience` (3) a bad document read in one step is a
skip, never diagnosed; so every run here rolls back at the first outlier (PATIENCE = 1):

- `clean`: the clean corpus, no faults, `steps` steps: every `spike_diagnosed` is a false
  diagnosis; its held-out loss is the fault run's reference;
- `base`: the clean corpus, `--base-steps` steps, promoted: the planted runs start from its
  weights (`train.init_from`, continued pre-training on a new corpus). A bad document
  matters to a model that has learned something: from scratch, the 230k-parameter model's
  loss still falls ~1 nat in 50 steps, its spread hides a planted document (robust z 3-5),
  and every token is nearly as hard as any other;
- `planted-K`: the planted corpus K (three token soups and one document of another kind, in
  turn; drawn from `--seed` + K), one epoch, from the base, at DATA_MICRO_BATCH_TOKENS a
  rank (a step's spread falls as the square root of its tokens; a soup fills most of a
  rank's micro-batch and can still be masked). A planted document lands where the packed
  epoch order puts it; the run's seed is the first from `--seed` on whose epoch-0 order
  puts every planted document in the run, at least DATA_GAP steps apart and after
  DATA_MIN_STEP, each soup inside one step (the placement is printed). Each one read whose step the detector calls an outlier is a
  `data` incident; those read with no outlier are counted apart, by kind (at this model's
  scale some kinds do no harm: the model learns to copy a run or a blob's alphabet, and
  there is nothing to find); `clean-planted-K`, the clean
  corpus at its seed and length from the same base, is its reference (held-out loss,
  false diagnoses);
- `planted-0-again`: planted-0's spec on its corpus with `data.quarantine` naming
  planted-0's quarantine (the end-to-end claim: the second run meets none of them);
- `faults`: the clean corpus with `lr_burst` (an `optimisation` incident) and
  `corrupt_grad` (a `numerics` incident: one gradient element NaN on the last rank, inside
  its optimizer step, after the gradient all-reduce: that rank's copy of the weights is
  the only one that breaks, trainer/replicas.py) at seeded random steps, GAP apart.

Figures (one JSON line): per kind, the share of incidents whose diagnosis names the
expected verdict (of all, and of those that led to a rollback: "none" is an incident with
no rollback, "undiagnosed" one whose rollback ran no diagnosis), and every verdict seen;
recall and precision of the planted documents among those accused, quarantined and masked;
the planted documents read with no outlier, by kind; clean sequences (rows holding no
planted document) skipped per incident, against what the old whole-window skip dropped;
false diagnoses and non-ok verdicts in the clean runs (clean, base, the references); the
diagnosis's cost per incident in steps' worth of training (the event's `steps_worth`, and
`replay_s` over the median step time); each run's final held-out loss over its
reference's; the second run's outliers; every input.

The full mode (the defaults: 10 faults of each kind in 1600 steps, 2000 clean steps, a
2000-step base, five planted runs of 4 documents, an epoch (~250 steps) each, and their
references) trains ~8,500 steps at W=2, two runs side by side.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import structlog

from benchmarks.spikes import CORPUS, INPUTS, eval_every, ratio, run, spec_for
from dataprep.clean import clean_one, clean_text, hash_unit
from dataprep.inputs import RawDocument, stdlib_dir
from dataprep.pipeline import prepare_dataset
from dataprep.tokens import load_tokenizer
from spec import RunSpec
from storage.checkpoints import CheckpointStore
from storage.dataset import read_split
from storage.provenance import load_provenance
from storage.quarantine import quarantine_entries, write_quarantine
from trainer.data import PackedBatches

KINDS = ("rare_run", "base64", "hex", "mojibake", "token_soup")  # planted documents
EXPECTED = {"data": "data", "lr_burst": "optimisation", "corrupt_grad": "numerics"}
GAP = 60  # steps between incidents: more than the detector's window (50), so each is its own
# Planted documents: a rollback resets the detector, which judges again after its warm-up
# (20 losses); every planted document of an epoch must lie in the run, this far apart.
DATA_GAP = 25
MIN_STEP = 80  # after the LR warm-up and the detector's first full window
TAIL = 30  # steps a spike needs to be judged (patience) before the run ends
# The diagnosis runs on a rollback. At the default patience (3) a bad document read in one
# or two steps is a skip (its update vetoed) and is never diagnosed; at 1 every outlier
# rolls back and is diagnosed (the clean runs count what that costs: any diagnosis there
# is a false one).
PATIENCE = 1
MAX_ROLLBACKS = 20  # a run that rolls back more often than this ends (the stopper's rule)
EXTRA = ("--max-rollbacks", str(MAX_ROLLBACKS))
SHOWS_WITHIN = 4  # a fault's spike has its onset at most this many steps after it fires
# Each rank's micro-batch: twice benchmarks/spikes.py's, so that one planted document can be
# most of a rank's share of a step (a step's loss is the mean over ranks) and still be masked
MICRO_BATCH_TOKENS = 1024
ROWS = MICRO_BATCH_TOKENS // INPUTS["model.seq_len"]  # sequences per cursor and rank
# The planted runs' (and their references'): a step's loss spread falls as the square root
# of its tokens (more documents averaged: ~0.28 nats at 1024 a rank, ~0.2 at 2048), while a
# planted document that fills most of a micro-batch moves it by the same share of its own
# excess loss; at 1024 a token soup (~4 nats a token above the corpus) reached z ~6, the
# detector's bar, at 2048 ~10.
DATA_MICRO_BATCH_TOKENS = 2048
DATA_ROWS = DATA_MICRO_BATCH_TOKENS // INPUTS["model.seq_len"]
# An epoch of the planted corpus is ~250 steps at that size: its planted documents lie in
# [DATA_MIN_STEP, steps - TAIL] (the base's weights are trained, so only the detector's
# first window is waited for), DATA_GAP apart (a rollback resets the detector, which judges
# again after its 20-loss warm-up).
DATA_MIN_STEP = 60


# ---- planted documents (pure) ------------------------------------------------------------
# Each planted document is ~650-900 tokens with the corpus's tokenizer: large enough that
# its loss can move a step's (W=2: two 1024-token micro-batches), small enough to mask
# (trainer/spikes.py maskable: at most 960 of a micro-batch's 1024 slots).
def rare_run(rng: random.Random) -> str:
    """One rare letter (Runic, Ogham, Tifinagh: letters, so the non-text filter keeps it),
    repeated: one long word, no repeated line or n-gram for the repetition filters."""
    letter = chr(rng.choice([*range(0x16A0, 0x16EB), *range(0x2D30, 0x2D68)]))
    return letter * rng.randint(220, 290)  # 3 unseen bytes a letter


def base64_blob(rng: random.Random) -> str:
    raw = base64.b64encode(rng.randbytes(rng.randint(480, 620))).decode()
    return "\n".join(raw[i:i + 76] for i in range(0, len(raw), 76))


def hex_blob(rng: random.Random) -> str:
    raw = rng.randbytes(rng.randint(330, 430)).hex()
    return "\n".join(raw[i:i + 64] for i in range(0, len(raw), 64))


def mojibake(rng: random.Random) -> str:
    """Cyrillic and Greek words written as UTF-8 and read back as Latin-1."""
    letters = [*map(chr, range(0x430, 0x450)), *map(chr, range(0x3B1, 0x3CA))]
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 7)))
             for _ in range(rng.randint(28, 36))]
    return " ".join(words).encode("utf-8").decode("latin-1")


# A token soup's length in the corpus's tokens: most of a rank's micro-batch
# (DATA_MICRO_BATCH_TOKENS), so its loss moves the step's, and at most that less a sequence
# (spikes.maskable), so it is masked, not its window skipped.
SOUP_TOKENS = (1860, 1960)


def token_soup(rng: random.Random, tok, pieces: Sequence[int]) -> str:
    """Garbled text: word pieces of the corpus's own vocabulary (`pieces`: its rarer merged
    tokens, `soup_pieces`) drawn at random and decoded, as a broken extractor or a spam
    page leaves them. Unlike a run or a blob, nothing in it is learnable, so training does
    not make it cheaper: on the benchmark's model pieces of the whole vocabulary cost ~8.8
    nats a token at 300 and at 600 steps (the rarer half ~9.2), where the corpus falls from
    5.8 to 5.3 and a rare letter's run from 10.5 to ~6 (its copying is learned). Sized to
    SOUP_TOKENS re-encoded (decoding and encoding again merges a few pieces)."""
    lo, hi = SOUP_TOKENS
    ids = [rng.choice(pieces) for _ in range(lo)]
    for _ in range(50):
        text = tok.decode(ids)
        n = len(tok.encode(text).ids)
        if lo <= n <= hi:
            return text
        if n > hi:
            ids = ids[:len(ids) - (n - hi) - 1]
        else:
            ids += [rng.choice(pieces) for _ in range(lo - n + 1)]
    raise RuntimeError(f"no token soup of {lo}-{hi} tokens in 50 tries")


def soup_pieces(tokens: np.ndarray, vocab: int) -> list[int]:
    """Pure: the merged tokens (ids from 256: past the byte alphabet) that occur in a split
    (`tokens`), the rarer half of them by count."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab)
    seen = [i for i in np.argsort(counts, kind="stable").tolist() if i >= 256 and counts[i]]
    return seen[:max(1, len(seen) // 2)]


PLANTERS = {"rare_run": rare_run, "base64": base64_blob, "hex": hex_blob, "mojibake": mojibake}


def plant(kind: str, rng: random.Random, val_fraction: float, normalize: str = "NFC",
          tok=None, pieces: Sequence[int] = ()) -> str:
    """A document of `kind` whose cleaned text's hash puts it in the train split; a
    `token_soup` needs the corpus's tokenizer `tok` and the `pieces` it draws."""
    while True:
        text = token_soup(rng, tok, pieces) if kind == "token_soup" else PLANTERS[kind](rng)
        cleaned = clean_text(text, normalize)[0]
        if hash_unit(hashlib.sha256(cleaned.encode()).hexdigest()) >= val_fraction:
            return text


def filter_verdict(text: str, cleaning) -> str | None:
    """The cleaning filter that drops `text` (a manifest stats key), or None: it is kept."""
    return clean_one(RawDocument("planted", text), cleaning).verdict


# ---- the figures (pure) ------------------------------------------------------------------
def spike_key(event_id: str) -> tuple[str, ...]:
    """(step, onset, restored step) of a `spike_diagnosed/…` or `rollback/…` event id (the
    writer's suffix after them differs between the two)."""
    return tuple(event_id.split("/")[1:4])


def diagnoses(events: list[dict]) -> list[dict]:
    """Each rollback with the `spike_diagnosed` event that decided it (same step, onset and
    restored step), in order; verdict "undiagnosed" where none did (a non-finite loss has
    no threshold to replay against)."""
    found = {spike_key(e["event_id"]): e for e in events if e["kind"] == "spike_diagnosed"}
    out = []
    for e in events:
        if e["kind"] != "rollback" or "onset" not in e["payload"]:
            continue
        p, d = e["payload"], found.get(spike_key(e["event_id"]), {}).get("payload", {})
        out.append({"step": p["at_step"], "onset": p["onset"], "window": p["window"],
                    "skipped": p.get("skipped"), "verdict": d.get("verdict", "undiagnosed"),
                    "documents": d.get("documents", []), "steps_worth": d.get("steps_worth"),
                    "replay_s": d.get("replay_s"),
                    "sources": [x["source"].rsplit("/", 1)[-1] for x in d.get("sources", [])]})
    return out


def spiked(incidents: list[dict], events: list[dict], within: int = 0) -> list[dict]:
    """Each incident with `spiked`: the detector called a step it struck an outlier (a
    `loss_spike` event at its step, the next for a document across two steps, or up to
    `within` steps after a fault). A planted document or a fault whose steps stayed under
    the threshold did no harm to diagnose."""
    outliers = {e["step"] for e in events if e["kind"] == "loss_spike"}
    return [{**i, "spiked": any(s in outliers for s in range(
        i["step"], i["step"] + 1 + max(within, int(bool(i.get("two_steps"))))))}
        for i in incidents]


def count_by(items: list[dict], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[i[key]] = out.get(i[key], 0) + 1
    return dict(sorted(out.items()))


def matches(incident: dict, diagnosis: dict) -> bool:
    """A data incident: its document accused, or its first cursor in the rollback's window;
    a fault: the spike's onset in the steps the fault shows in."""
    if incident["kind"] == "data":
        lo, hi = diagnosis["window"]
        return incident["document"] in diagnosis["documents"] or lo <= incident["cursor"] < hi
    return incident["step"] <= diagnosis["onset"] <= incident["step"] + SHOWS_WITHIN


def judge(incidents: list[dict], found: list[dict]) -> tuple[list[dict], list[dict]]:
    """(each incident with the verdict of its first matching diagnosis, or "none"; the
    diagnoses no incident explains)."""
    used: set[int] = set()
    out = []
    for inc in incidents:
        hit = next((i for i, d in enumerate(found) if i not in used and matches(inc, d)), None)
        if hit is not None:
            used.add(hit)
        out.append({**inc, "verdict": found[hit]["verdict"] if hit is not None else "none",
                    "diagnosis": hit})
    return out, [d for i, d in enumerate(found) if i not in used]


def accuracy(judged: list[dict]) -> dict[str, dict]:
    """Per incident kind: incidents, correct (the expected verdict), their share, and every
    verdict seen with its count."""
    out: dict[str, dict] = {}
    for kind in EXPECTED:
        mine = [j for j in judged if j["kind"] == kind]
        correct = sum(j["verdict"] == EXPECTED[kind] for j in mine)
        seen: dict[str, int] = {}
        for j in mine:
            seen[j["verdict"]] = seen.get(j["verdict"], 0) + 1
        rolled = len(mine) - seen.get("none", 0)
        out[kind] = {"incidents": len(mine), "correct": correct,
                     "accuracy": round(correct / len(mine), 3) if mine else None,
                     "rolled_back": rolled, "accuracy_of_rolled_back":
                     round(correct / rolled, 3) if rolled else None,
                     "verdicts": dict(sorted(seen.items()))}
    return out


def by_planted_kind(judged: list[dict]) -> dict[str, dict[str, int]]:
    """The data incidents' verdicts per kind of planted document ("none": no rollback)."""
    out: dict[str, dict[str, int]] = {}
    for j in judged:
        if j["kind"] == "data":
            seen = out.setdefault(j["planted"], {})
            seen[j["verdict"]] = seen.get(j["verdict"], 0) + 1
    return out


def recall_precision(accused: set[int], planted_read: set[int], planted: set[int]
                     ) -> dict[str, float | None]:
    """Recall: planted documents read in the run that were accused; precision: accused
    documents that were planted (None with nothing to divide)."""
    return {"recall": round(len(accused & planted_read) / len(planted_read), 3)
            if planted_read else None,
            "precision": round(len(accused & planted) / len(accused), 3) if accused else None,
            "accused": len(accused), "planted_read": len(planted_read)}


def clean_rows_in(window: list[int], dirty_rows: set[int], rows_per_cursor: int) -> int:
    """Rows (sequences) of the cursors [lo, hi) that hold no planted document."""
    lo, hi = window
    return sum(1 for r in range(lo * rows_per_cursor, hi * rows_per_cursor)
               if r not in dirty_rows)


def clean_skips(found: list[dict], dirty_rows: set[int], rows_per_cursor: int
                ) -> tuple[list[int], list[int]]:
    """Clean sequences each rollback skipped now (a window skip drops its clean rows; a
    document skip masks documents, no rows) and under the old rule (always the window)."""
    now = [clean_rows_in(d["window"], dirty_rows, rows_per_cursor)
           if d["skipped"] == "window" else 0 for d in found]
    return now, [clean_rows_in(d["window"], dirty_rows, rows_per_cursor) for d in found]


def per_incident(now: list[int], old: list[int]) -> dict:
    n = max(1, len(now))
    return {"per_incident": round(sum(now) / n, 2), "old_window_skip_per_incident":
            round(sum(old) / n, 2), "rollbacks": len(now)}


def skipped_clean(found: list[dict], dirty_rows: set[int], rows_per_cursor: int) -> dict:
    """Clean sequences skipped per rollback, now and under the old whole-window rule."""
    return per_incident(*clean_skips(found, dirty_rows, rows_per_cursor))


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 3) if values else None


# ---- corpus, placement, runs -------------------------------------------------------------
def clean_corpus(root: Path) -> str:
    """The clean corpus's manifest: the stdlib files through the real data prep."""
    clean, _, _ = prepare_dataset(RunSpec(run_id="x").replace(
        **{"data.corpus": CORPUS, "data.workers": 1}).data, str(root / "datasets"), seed=0)
    return clean


def planted_corpus(root: Path, clean: str, counts: dict[str, int], seed: int, name: str,
                   quarantine: tuple[str, ...] = ()) -> tuple[str, dict, object]:
    """(manifest, what became of each planted kind, the manifest object): the stdlib files
    plus `counts` planted documents of each kind drawn from `seed`, through the real data
    prep with the clean corpus's tokenizer (so held-out losses compare); `quarantine`:
    quarantine files whose documents that data prep drops."""
    cleaning = RunSpec(run_id="x").data.cleaning
    val_fraction = RunSpec(run_id="x").data.val_fraction
    tokenizer = clean.rsplit("/", 1)[0] + "/tokenizer.json"
    tok = load_tokenizer(tokenizer)
    pieces = soup_pieces(read_split(clean, "train")[0], tok.get_vocab_size())
    corpus = root / f"corpus-{name}"
    shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir(parents=True)
    for f in sorted(Path(stdlib_dir()).glob("*.py")):
        shutil.copyfile(f, corpus / f.name)
    rng, report = random.Random(seed), {}
    for kind in KINDS:
        texts = [plant(kind, rng, val_fraction, cleaning.normalize, tok, pieces)
                 for _ in range(counts.get(kind, 0))]
        verdicts = [filter_verdict(t, cleaning) for t in texts]
        report[kind] = {"made": len(texts), "pass_filters": verdicts.count(None),
                        "dropped_by": sorted({v for v in verdicts if v})}
        for i, text in enumerate(texts):
            (corpus / f"zz-planted-{kind}-{i}.txt").write_text(text)
    planted, manifest, _ = prepare_dataset(RunSpec(run_id="x").replace(
        **{"data.corpus": str(corpus), "data.workers": 1, "data.tokenizer.path": tokenizer,
           "data.quarantine": list(quarantine)}).data, str(root / "datasets"), seed=0)
    return planted, report, manifest


def planted_documents(dataset: str) -> dict[int, str]:
    """Document number in the train split -> planted kind, from the provenance index."""
    index = load_provenance(dataset, "train").index
    _, starts = read_split(dataset, "train")
    out = {}
    for d in range(len(starts)):
        name = index.entry(d).source.rsplit("/", 1)[-1]
        if name.startswith("zz-planted-"):
            out[d] = name.split("-")[2]
    return out


def landings(batches: PackedBatches, documents: list[int]) -> dict[int, tuple[int, list[int]]]:
    """Document -> (its first cursor in epoch 0, the rows it spans there)."""
    order, offsets = batches.layout(0)
    seq, per = batches.seq_len, batches.batch_size * batches.world
    out = {}
    for d in documents:
        pos = int(np.flatnonzero(order == d)[0])
        rows = list(range(int(offsets[pos]) // seq, (int(offsets[pos + 1]) - 1) // seq + 1))
        out[d] = (rows[0] // per, rows)
    return out


def place_data(dataset: str, planted: dict[int, str], steps: int, want: int, seed: int,
               world: int = 1) -> tuple[int, list[dict], set[int]]:
    """The first seed from `seed` whose epoch-0 order puts `want` planted documents in
    [DATA_MIN_STEP, steps - TAIL], DATA_GAP apart, each token soup inside one step, and
    none elsewhere in the run: (seed, the data incidents, every row holding a planted
    document in epoch 0)."""
    tokens, starts = read_split(dataset, "train")
    for s in range(seed, seed + 5000):
        batches = PackedBatches(tokens, starts, seq_len=INPUTS["model.seq_len"],
                                batch_size=DATA_ROWS, seed=s, world=world)
        land = landings(batches, list(planted))
        read = sorted((c + 1, d) for d, (c, _) in land.items() if c + 1 <= steps)
        ok = [st for st, _ in read if DATA_MIN_STEP <= st <= steps - TAIL]
        across = {d for _, d in read
                  if land[d][1][-1] // (DATA_ROWS * batches.world) > land[d][0]}
        # a soup split over two steps moves each by half of what it would: in one step each
        whole = not any(planted[d] == "token_soup" for d in across)
        if len(read) >= want and len(ok) == len(read) and whole and all(
                b - a >= DATA_GAP for a, b in zip(ok, ok[1:])):
            dirty = {r for _, rows in land.values() for r in rows}
            return s, [{"kind": "data", "planted": planted[d], "document": d,
                        "cursor": land[d][0], "step": st, "two_steps": d in across}
                       for st, d in read], dirty
    raise RuntimeError(f"no seed in [{seed}, {seed + 5000}) places {want} planted documents")


def place_faults(n: int, steps: int, seed: int, rank: int = 0) -> list[dict]:
    """`n` LR bursts and `n` corrupt_grad faults at seeded random steps, GAP apart."""
    rng, taken = random.Random(seed), []
    while len(taken) < 2 * n:
        s = rng.randint(MIN_STEP, steps - TAIL)
        if all(abs(s - t) >= GAP for t in taken):
            taken.append(s)
    kinds = ["lr_burst", "corrupt_grad"] * n
    rng.shuffle(kinds)
    return [{"kind": "lr_burst", "at_step": s, "steps": 2, "factor": 100.0}
            if k == "lr_burst" else {"kind": "corrupt_grad", "at_step": s, "rank": rank}
            for s, k in sorted(zip(taken, kinds))]


def median_step_s(r: dict) -> float | None:
    times = [s["step_time_s"] for s in r["steps"] if s.get("step_time_s")]
    return statistics.median(times) if times else None


def final_ratio(r: dict, clean: dict) -> dict:
    """Held-out loss over the clean run's at the last evaluation both made."""
    last = max((s for s in r["evals"] if s in clean["evals"]), default=None)
    return {"step": last, "ratio": ratio(r["evals"][last], clean["evals"][last])
            if last else None}


def figures(runs: dict[str, dict], faults: list[dict], data_runs: list[dict],
            world: int = 1) -> dict:
    """The JSON line's figures from the finished runs. `data_runs`: per planted run, its
    name, its reference run's, its incidents, its planted documents and the rows holding
    them; documents are told apart across runs by (run, number)."""
    clean, faulty = runs["clean"], runs["faults"]
    cleans = [r for k, r in runs.items() if k.startswith("clean") or k == "base"]
    fired = {(e["payload"]["kind"], e["payload"]["at_step"]): e["step"]
             for e in faulty["events"] if e["kind"] == "fault"}
    fault_incidents = [{"kind": f["kind"], "at_step": f["at_step"],
                        "step": fired.get((f["kind"], f["at_step"]), f["at_step"]),
                        "fired": (f["kind"], f["at_step"]) in fired} for f in faults]
    found_faults = diagnoses(faulty["events"])
    fault_incidents = spiked(fault_incidents, faulty["events"], SHOWS_WITHIN)
    judged, stray_faults = judge([i for i in fault_incidents if i["spiked"]], found_faults)
    quiet_faults = [i for i in fault_incidents if not i["spiked"]]
    found_data, stray_data, incidents, skips = [], [], [], ([], [])
    accused, quarantined, masked, planted = set(), set(), set(), set()
    for d in data_runs:
        events, k = runs[d["name"]]["events"], d["name"]
        found = [{**f, "run": k} for f in diagnoses(events)]
        mine = [{**i, "run": k} for i in spiked(d["incidents"], events)]
        hit, stray = judge([i for i in mine if i["spiked"]], found)
        judged, stray_data = hit + judged, stray_data + stray
        found_data, incidents = found_data + found, incidents + mine
        accused |= {(k, x) for f in found if f["verdict"] == "data" for x in f["documents"]}
        quarantined |= {(k, q.document) for q in quarantine_entries(events)}
        masked |= {(k, x) for f in found if f["skipped"] == "documents" for x in f["documents"]}
        planted |= {(k, x) for x in d["planted"]}
        now, old = clean_skips(found, d["dirty"], DATA_ROWS * world)
        skips[0].extend(now)
        skips[1].extend(old)
    read = {(i["run"], i["document"]) for i in incidents if i["spiked"]}
    harmless = [i for i in incidents if not i["spiked"]]
    found = found_data + found_faults
    step_s = median_step_s(clean)
    return {
        "accuracy": accuracy(judged),
        "data_verdicts_by_planted_kind": by_planted_kind(judged),
        # of the planted documents whose step spiked (an incident); those read without one
        # are counted apart, by kind: at this model's scale they did no harm to find
        "planted_accused": recall_precision(accused, read, planted),
        "planted_quarantined": recall_precision(quarantined, read, planted),
        "planted_masked": recall_precision(masked, read, planted),
        # faults that moved no loss past the detector (a burst late in the LR decay) did no
        # harm to diagnose
        "faults_without_spike": {"count": len(quiet_faults),
                                 "by_kind": count_by(quiet_faults, "kind"),
                                 "of_fired": len(fault_incidents),
                                 "steps": [[i["kind"], i["step"]] for i in quiet_faults]},
        "planted_read_without_spike": {
            "count": len(harmless), "by_kind": count_by(harmless, "planted"),
            "of_read": len(incidents),
            "steps": [[i["run"], i["planted"], i["step"]] for i in harmless]},
        # the accused documents' records as the diagnosis named them (provenance index)
        "accused_sources": {"named": sum(len(f["sources"]) for f in found_data),
                            "planted_files": sum(x.startswith("zz-planted-")
                                                 for f in found_data for x in f["sources"])},
        "clean_sequences_skipped": {"data": per_incident(*skips),
                                    "faults": skipped_clean(found_faults, set(), ROWS * world)},
        "false_diagnoses_clean_runs": sum(1 for r in cleans for e in r["events"]
                                          if e["kind"] == "spike_diagnosed"),
        "clean_runs_nonok_verdicts": sum(1 for r in cleans for s in r["steps"]
                                         if s["verdict"] != "ok"),
        "clean_steps": sum(len(r["steps"]) for r in cleans),
        "unmatched_diagnoses": {"data": len(stray_data), "faults": len(stray_faults)},
        "forensics_steps_worth_per_incident": mean([f["steps_worth"] for f in found]),
        "forensics_replay_s_per_incident": mean([f["replay_s"] for f in found]),
        "forensics_wall_steps_per_incident": mean([f["replay_s"] / step_s for f in found
                                                   if f["replay_s"] is not None])
        if step_s else None,
        "final_val_loss_ratio_vs_clean": {
            "data": {d["name"]: final_ratio(runs[d["name"]], runs.get(d["ref"], clean))
                     for d in data_runs},
            "faults": final_ratio(faulty, clean)},
        "incidents": judged, "diagnoses": {"data": found_data, "faults": found_faults},
        "median_step_s": step_s}


def rerun_figures(rerun: dict, first: dict, planted: dict[int, str], dirty_steps: set[int],
                  dropped: int) -> dict:
    """The second run of the first planted run's spec, on its corpus less the documents the
    first run's quarantine names: its outliers, at the steps that read a planted document
    left in, and its held-out loss over the first run's."""
    outliers = sorted({e["step"] for e in rerun["events"] if e["kind"] == "loss_spike"})
    return {"quarantine_dropped": dropped, "planted_left": len(planted),
            "outliers": len(outliers), "outlier_steps": outliers[:20],
            "outliers_at_planted_left": sorted(set(outliers) & dirty_steps),
            "diagnoses": sum(1 for e in rerun["events"] if e["kind"] == "spike_diagnosed"),
            "final_val_loss_ratio_vs_first": final_ratio(rerun, first)}


# Planted documents per kind and planted run (an epoch of ~500 steps holds six, DATA_GAP
# apart). The full mode plants more of the kinds that moved a step's loss in the quick mode
# (a run of one rare letter, mojibake: ~12 nats a token on a trained model against ~5-6 for
# the corpus) in four runs, so that ten incidents at least are data; base64 and hex blobs
# (~6 nats) are planted too and counted.
OTHER_KINDS = tuple(k for k in KINDS if k != "token_soup")


def run_counts(k: int) -> dict[str, int]:
    """Pure: planted run `k`'s documents per kind: three token soups and one of the other
    kinds, in turn (an epoch holds four, DATA_GAP apart, the soups each in one step)."""
    return {"token_soup": 3, OTHER_KINDS[k % len(OTHER_KINDS)]: 1}


def data_run(root: Path, clean: str, k: int, args, steps: int, counts: dict[str, int]
             ) -> dict:
    """Planted run `k`: its corpus (planted from seed + k), its seed (the first that places
    every planted document in it, DATA_GAP apart) and what it is judged against."""
    name = f"planted-{k}"
    dataset, report, manifest = planted_corpus(root, clean, counts, args.seed + k, name)
    planted = planted_documents(dataset)
    for kind in KINDS:
        report[kind]["in_train"] = sum(1 for x in planted.values() if x == kind)
    tokens, _ = read_split(dataset, "train")
    epoch = -(-tokens.size // INPUTS["model.seq_len"]) // (DATA_ROWS * args.world)
    run_steps = min(steps, epoch)  # one epoch at most: each planted document read once
    seed, incidents, dirty = place_data(dataset, planted, run_steps, len(planted), args.seed,
                                        args.world)
    return {"name": name, "ref": f"clean-{name}", "dataset": dataset, "planted": planted,
            "incidents": incidents, "dirty": dirty, "seed": seed, "steps": run_steps,
            "epoch_steps": epoch, "planted_report": report, "vocab_size": manifest.vocab_size}


def second_run(root: Path, clean: str, first: dict, runs: dict, args, counts, every: dict,
               timeout: float) -> dict:
    """The first planted run's spec again, on its corpus with `data.quarantine` naming the
    first run's quarantine (written from its events, as the workflow writes it)."""
    spec = runs[first["name"]]["spec"]
    uri, _ = write_quarantine(spec.storage.durable, spec.run_id)
    dataset, _, manifest = planted_corpus(root, clean, counts, args.seed, first["name"],
                                          quarantine=(uri,))
    planted = planted_documents(dataset)
    land = landings(PackedBatches(*read_split(dataset, "train"), seq_len=INPUTS["model.seq_len"],
                                  batch_size=DATA_ROWS, seed=first["seed"], world=args.world),
                    list(planted))
    steps = {c + 1 + i for c, rows in land.values() for i in range(2)}
    again = run(root, dataset, spec_for(root, f"{first['name']}-again", first["seed"],
                                        first["steps"], **every), timeout, EXTRA)
    return {**rerun_figures(again, runs[first["name"]], planted, steps,
                            int(manifest.stats.get("dropped_quarantined", 0))),
            "error": again["error"], "seconds": round(again["seconds"], 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000,
                    help="the clean run's steps (the base and the references are clean too)")
    ap.add_argument("--fault-steps", type=int, default=1600, help="the fault run's steps")
    ap.add_argument("--incidents", type=int, default=10, help="faults of each kind")
    ap.add_argument("--data-runs", type=int, default=5, help="planted runs, an epoch each")
    ap.add_argument("--base-steps", type=int, default=2000,
                    help="the clean run the planted runs start from (train.init_from)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--world", type=int, default=2,
                    help="ranks per run (DeepSpeed ZeRO 0 on gloo); corrupt_grad strikes the last")
    ap.add_argument("--jobs", type=int, default=2, help="segments run side by side")
    ap.add_argument("--quick", action="store_true",
                    help="600-step runs, 2 faults of each kind, one planted run")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(),
                                                      "mainspring-bench-forensics"))
    args = ap.parse_args(argv)
    steps, fault_steps, base_steps, n, data_runs = (
        (600, 600, 300, 2, 1) if args.quick else
        (args.steps, args.fault_steps, args.base_steps, args.incidents, args.data_runs))
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    t0, root = time.time(), Path(args.workdir)
    clean = clean_corpus(root)
    planted = [data_run(root, clean, k, args, steps, run_counts(k)) for k in range(data_runs)]
    faults = place_faults(n, fault_steps, args.seed, rank=args.world - 1)
    # the same evaluation steps in every run; a rollback (and a diagnosis) on one outlier
    every = {"train.eval_every": eval_every(steps), "spikes.patience": PATIENCE,
             "train.procs_per_node": args.world, "train.micro_batch_tokens": MICRO_BATCH_TOKENS}
    data = {**every, "train.micro_batch_tokens": DATA_MICRO_BATCH_TOKENS}  # planted runs
    # the base run and the runs that start from its promoted weights share one store
    shared = root / "shared"
    shutil.rmtree(shared, ignore_errors=True)
    init = {"storage.durable": str(shared), "train.init_from": f"base@{base_steps}"}
    timeout = 300 + 0.5 * max(steps, base_steps) * max(1, args.jobs) * args.world
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        def start(spec: RunSpec, dataset: str):
            return pool.submit(run, root, dataset, spec, timeout, EXTRA)

        pending = [start(spec_for(root, "clean", args.seed, steps, **every), clean)]
        base = start(spec_for(root, "base", args.seed, base_steps, **every,
                              **{"storage.durable": str(shared)}), clean).result()
        if base["error"]:
            raise SystemExit(f"the base run failed: {base['error']}")
        CheckpointStore(str(shared), "base").promote(base_steps)
        pending.append(start(spec_for(root, "faults", args.seed, fault_steps, faults=faults,
                                      **every), clean))
        for d in planted:  # each from the base's weights; its reference: the clean corpus
            pending.append(start(spec_for(root, d["name"], d["seed"], d["steps"], **data,
                                          **init), d["dataset"]))
            pending.append(start(spec_for(root, d["ref"], d["seed"], d["steps"], **data,
                                          **init), clean))
        runs = {r["name"]: r for r in (f.result() for f in pending)}
    runs["base"] = base
    out = figures(runs, faults, planted, args.world)
    again = second_run(root, clean, planted[0], runs, args, run_counts(0), {**data, **init},
                       timeout) if not runs[planted[0]["name"]]["error"] else None
    print(json.dumps({
        "figure": "spike_forensics", **out, "second_run_with_quarantine": again,
        "planted": {d["name"]: d["planted_report"] for d in planted},
        "errors": {k: r["error"] for k, r in runs.items() if r["error"]},
        "inputs": {"model": {k[6:]: v for k, v in INPUTS.items() if k.startswith("model.")},
                   "params": runs["clean"]["params"], "corpus": CORPUS, "world_size": args.world,
                   "vocab_size": planted[0]["vocab_size"], "steps": steps,
                   "fault_steps": fault_steps, "base_steps": base_steps, "seed": args.seed,
                   "data_runs": {d["name"]: {"seed": d["seed"], "steps": d["steps"],
                                             "epoch_steps": d["epoch_steps"]} for d in planted},
                   "faults_per_kind": n, "planted_per_kind_per_run": {
                       d["name"]: run_counts(k) for k, d in enumerate(planted)}, "faults": faults,
                   "gap": GAP, "data_gap": DATA_GAP, "min_step": MIN_STEP, "tail": TAIL,
                   "data_min_step": DATA_MIN_STEP, "rows_per_cursor": ROWS * args.world,
                   "data_rows_per_cursor": DATA_ROWS * args.world,
                   "micro_batch_tokens": MICRO_BATCH_TOKENS,
                   "data_micro_batch_tokens": DATA_MICRO_BATCH_TOKENS,
                   "spikes_patience": PATIENCE,
                   "jobs": args.jobs, "quick": args.quick, "max_rollbacks": MAX_ROLLBACKS,
                   "seconds_per_run": {k: round(r["seconds"], 1) for k, r in runs.items()},
                   "final_step_per_run": {k: r["result"].get("final_step")
                                          for k, r in runs.items()},
                   "stopped_per_run": {k: r["result"].get("outcome", {}).get("stopped")
                                       for k, r in runs.items()},
                   "load_average": os.getloadavg()[0]},
        "seconds": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
