"""Spike forensics: how well a spike's diagnosis (trainer/diagnosis.py) tells causes apart.

    .venv/bin/python benchmarks/spike_forensics.py [--quick] [--steps 5000] [--incidents 10]
                                                   [--seed 1] [--jobs 2] [--workdir DIR]

Corpus: this Python's standard-library top-level sources, as `benchmarks/spikes.py` uses
them, copied into a directory with planted bad documents beside them: runs of one rare
character, base64 blobs, hex blobs and mojibake (UTF-8 read as Latin-1), each of which
passes data prep's cleaning filters (checked here: a kind a filter drops is reported in
`planted`, never counted) and is drawn until its hash puts it in the train split. Both
corpora go through the real data prep (`prepare_dataset`: cleaning, dedup, the provenance
index); the planted one reuses the clean one's tokenizer, so both have the same held-out
tokens and their held-out losses compare.

Runs (the real `trainer.segment` under torchrun, `benchmarks/spikes.py`'s `run` and
`spec_for`; one process, W=1: that runner starts one rank). A diagnosis runs on a
rollback, and at the default `spikes.patience` (3) a bad document read in one step is a
skip, never diagnosed; so every run here rolls back at PATIENCE = 2 outliers and half the
planted documents at least are placed across two steps' micro-batches:

- `clean`: the clean corpus, no faults, `steps` steps: every `spike_diagnosed` is a false
  diagnosis; its held-out loss is the reference (`clean-data-seed` too, at the data
  run's seed and length, the data run's reference);
- `planted`: the planted corpus. A planted document lands where the packed epoch order puts
  it; the run's seed is the first from `--seed` on whose epoch-0 order puts the wanted
  number of planted documents in the run, at least GAP steps apart and after MIN_STEP
  (the placement is printed). Each one read is a `data` incident;
- `faults`: the clean corpus with `lr_burst` (an `optimisation` incident) and
  `corrupt_grad` (a `numerics` incident: one gradient element NaN on one rank, inside its
  optimizer step) at seeded random steps, GAP apart.

Figures (one JSON line): per kind, the share of incidents whose diagnosis names the
expected verdict (of all, and of those that led to a rollback: "none" is an incident with
no rollback, "undiagnosed" one whose rollback ran no diagnosis), and every verdict
seen; recall and precision of the planted documents among those accused; clean sequences (rows holding no planted document) skipped per
incident, against what the old whole-window skip dropped; false diagnoses in the clean
run; the diagnosis's cost per incident in steps' worth of training (the event's
`steps_worth`, and `replay_s` over the median step time); each run's final held-out loss
over the clean run's at that step; every input.

The full mode (the defaults: 10 incidents of each kind, 5000 clean steps, the data run as
long as the epoch its 12 planted documents lie in, ~2000 steps) trains ~14,000 steps in
four segments, two side by side: at the quick mode's pace (4 x 600 steps in 54-98 s)
about 10 minutes on 2 shared cores, plus the seed search (under a second). Not run yet.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import structlog

from benchmarks.spikes import CORPUS, INPUTS, eval_every, ratio, run, spec_for
from dataprep.clean import clean_one, clean_text, hash_unit
from dataprep.inputs import RawDocument, stdlib_dir
from dataprep.pipeline import prepare_dataset
from spec import RunSpec
from storage.dataset import read_split
from storage.provenance import load_provenance
from trainer.data import PackedBatches

KINDS = ("rare_run", "base64", "hex", "mojibake")  # planted documents
EXPECTED = {"data": "data", "lr_burst": "optimisation", "corrupt_grad": "numerics"}
GAP = 60  # steps between incidents: more than the detector's window (50), so each is its own
MIN_STEP = 80  # after the LR warm-up and the detector's first full window
TAIL = 30  # steps a spike needs to be judged (patience) before the run ends
# The diagnosis runs on a rollback. At the default patience (3) a bad document read in one
# or two steps is a skip (its update vetoed) and is never diagnosed; at 2, one that
# straddles two steps' micro-batches is a sustained spike (tests/trainer/
# test_spike_verdicts.py plants its document so), and planted documents are placed so
# (half of them at least: all twelve of the full mode across two steps is too rare a seed).
PATIENCE = 2
MAX_ROLLBACKS = 20  # a run that rolls back more often than this ends (the stopper's rule)
SHOWS_WITHIN = 4  # a fault's spike has its onset at most this many steps after it fires
ROWS = INPUTS["train.micro_batch_tokens"] // INPUTS["model.seq_len"]  # sequences per cursor


# ---- planted documents (pure) ------------------------------------------------------------
def rare_run(rng: random.Random) -> str:
    """One rare letter (Runic, Ogham, Tifinagh: letters, so the non-text filter keeps it),
    repeated: one long word, no repeated line or n-gram for the repetition filters."""
    letter = chr(rng.choice([*range(0x16A0, 0x16EB), *range(0x2D30, 0x2D68)]))
    return letter * rng.randint(64, 80)  # 3 unseen bytes a letter: ~190-240 tokens


def base64_blob(rng: random.Random) -> str:
    raw = base64.b64encode(rng.randbytes(rng.randint(150, 190))).decode()
    return "\n".join(raw[i:i + 76] for i in range(0, len(raw), 76))


def hex_blob(rng: random.Random) -> str:
    raw = rng.randbytes(rng.randint(100, 125)).hex()
    return "\n".join(raw[i:i + 64] for i in range(0, len(raw), 64))


def mojibake(rng: random.Random) -> str:
    """Cyrillic and Greek words written as UTF-8 and read back as Latin-1."""
    letters = [*map(chr, range(0x430, 0x450)), *map(chr, range(0x3B1, 0x3CA))]
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(3, 7)))
             for _ in range(rng.randint(10, 13))]
    return " ".join(words).encode("utf-8").decode("latin-1")


PLANTERS = {"rare_run": rare_run, "base64": base64_blob, "hex": hex_blob, "mojibake": mojibake}


def plant(kind: str, rng: random.Random, val_fraction: float, normalize: str = "NFC") -> str:
    """A document of `kind` whose cleaned text's hash puts it in the train split."""
    while True:
        text = PLANTERS[kind](rng)
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


def skipped_clean(found: list[dict], dirty_rows: set[int], rows_per_cursor: int) -> dict:
    """Clean sequences skipped per rollback now (a window skip drops its clean rows; a
    document skip masks documents, no rows) and under the old rule (always the window)."""
    now = [clean_rows_in(d["window"], dirty_rows, rows_per_cursor)
           if d["skipped"] == "window" else 0 for d in found]
    old = [clean_rows_in(d["window"], dirty_rows, rows_per_cursor) for d in found]
    n = max(1, len(found))
    return {"per_incident": round(sum(now) / n, 2), "old_window_skip_per_incident":
            round(sum(old) / n, 2), "rollbacks": len(found)}


def mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 3) if values else None


# ---- corpus, placement, runs -------------------------------------------------------------
def corpora(root: Path, per_kind: int, seed: int) -> tuple[str, str, dict, object]:
    """(clean manifest, planted manifest, what became of each planted kind, the planted
    manifest object). The planted corpus is the stdlib files plus the planted documents."""
    cleaning = RunSpec(run_id="x").data.cleaning
    val_fraction = RunSpec(run_id="x").data.val_fraction
    clean, _, _ = prepare_dataset(RunSpec(run_id="x").replace(
        **{"data.corpus": CORPUS, "data.workers": 1}).data, str(root / "datasets"), seed=0)
    tokenizer = clean.rsplit("/", 1)[0] + "/tokenizer.json"
    corpus = root / "corpus"
    shutil.rmtree(corpus, ignore_errors=True)
    corpus.mkdir(parents=True)
    for f in sorted(Path(stdlib_dir()).glob("*.py")):
        shutil.copyfile(f, corpus / f.name)
    rng, report = random.Random(seed), {}
    for kind in KINDS:
        texts = [plant(kind, rng, val_fraction, cleaning.normalize) for _ in range(per_kind)]
        verdicts = [filter_verdict(t, cleaning) for t in texts]
        report[kind] = {"made": len(texts), "pass_filters": verdicts.count(None),
                        "dropped_by": sorted({v for v in verdicts if v})}
        for i, text in enumerate(texts):
            (corpus / f"zz-planted-{kind}-{i}.txt").write_text(text)
    planted, manifest, _ = prepare_dataset(RunSpec(run_id="x").replace(
        **{"data.corpus": str(corpus), "data.workers": 1, "data.tokenizer.path": tokenizer}
    ).data, str(root / "datasets"), seed=0)
    return clean, planted, report, manifest


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


def place_data(dataset: str, planted: dict[int, str], steps: int, want: int, seed: int
               ) -> tuple[int, list[dict], set[int]]:
    """The first seed from `seed` whose epoch-0 order puts `want` planted documents in
    [MIN_STEP, steps - TAIL], GAP apart, half of them at least across two steps'
    micro-batches, and none elsewhere in the run: (seed, the data incidents, every row
    holding a planted document in epoch 0)."""
    tokens, starts = read_split(dataset, "train")
    mbs = INPUTS["train.micro_batch_tokens"] // INPUTS["model.seq_len"]
    for s in range(seed, seed + 5000):
        batches = PackedBatches(tokens, starts, seq_len=INPUTS["model.seq_len"],
                                batch_size=mbs, seed=s)
        land = landings(batches, list(planted))
        read = sorted((c + 1, d) for d, (c, _) in land.items() if c + 1 <= steps)
        ok = [st for st, _ in read if MIN_STEP <= st <= steps - TAIL]
        across = {d for _, d in read if land[d][1][-1] // (mbs * batches.world) > land[d][0]}
        if len(read) >= want and len(ok) == len(read) and 2 * len(across) >= len(read) and all(
                b - a >= GAP for a, b in zip(ok, ok[1:])):
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


def figures(runs: dict[str, dict], faults: list[dict], data_incidents: list[dict],
            planted: dict[int, str], dirty: set[int]) -> dict:
    """The JSON line's figures from the finished runs."""
    clean, data, faulty = runs["clean"], runs["planted"], runs["faults"]
    cleans = [r for k, r in runs.items() if k.startswith("clean")]
    fired = {(e["payload"]["kind"], e["payload"]["at_step"]): e["step"]
             for e in faulty["events"] if e["kind"] == "fault"}
    fault_incidents = [{"kind": f["kind"], "at_step": f["at_step"],
                        "step": fired.get((f["kind"], f["at_step"]), f["at_step"]),
                        "fired": (f["kind"], f["at_step"]) in fired} for f in faults]
    found_data, found_faults = diagnoses(data["events"]), diagnoses(faulty["events"])
    judged_data, stray_data = judge(data_incidents, found_data)
    judged_faults, stray_faults = judge(fault_incidents, found_faults)
    judged = judged_data + judged_faults
    accused = {d for f in found_data if f["verdict"] == "data" for d in f["documents"]}
    quarantined = {d for f in found_data if f["skipped"] == "documents" for d in f["documents"]}
    read = {i["document"] for i in data_incidents}
    found = found_data + found_faults
    step_s = median_step_s(clean)
    return {
        "accuracy": accuracy(judged),
        "data_verdicts_by_planted_kind": by_planted_kind(judged),
        "planted_accused": recall_precision(accused, read, set(planted)),
        "planted_quarantined": recall_precision(quarantined, read, set(planted)),
        # the accused documents' records as the diagnosis named them (provenance index)
        "accused_sources": {"named": sum(len(f["sources"]) for f in found_data),
                            "planted_files": sum(x.startswith("zz-planted-")
                                                 for f in found_data for x in f["sources"])},
        "clean_sequences_skipped": {"data": skipped_clean(found_data, dirty, ROWS),
                                    "faults": skipped_clean(found_faults, set(), ROWS)},
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
            "data": final_ratio(data, runs.get("clean-data-seed", clean)),
            "faults": final_ratio(faulty, clean)},
        "incidents": judged, "diagnoses": {"data": found_data, "faults": found_faults},
        "median_step_s": step_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5000, help="clean and fault runs' steps")
    ap.add_argument("--incidents", type=int, default=10, help="of each kind")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2, help="segments run side by side")
    ap.add_argument("--quick", action="store_true",
                    help="600 steps, 2 incidents of each kind, one planted document per kind")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(),
                                                      "mainspring-bench-forensics"))
    args = ap.parse_args(argv)
    steps, n = (600, 2) if args.quick else (args.steps, args.incidents)
    per_kind = 1 if args.quick else -(-(n + 2) // len(KINDS))  # a few spare documents
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    t0, root = time.time(), Path(args.workdir)
    clean_ds, planted_ds, report, manifest = corpora(root, per_kind, args.seed)
    planted = planted_documents(planted_ds)
    for kind in KINDS:
        report[kind]["in_train"] = sum(1 for k in planted.values() if k == kind)
    tokens, _ = read_split(planted_ds, "train")
    epoch = -(-tokens.size // INPUTS["model.seq_len"]) // ROWS
    data_steps = steps if args.quick else min(steps, epoch)
    data_seed, data_incidents, dirty = place_data(planted_ds, planted, data_steps,
                                                  min(n, len(planted)), args.seed)
    faults = place_faults(n, steps, args.seed)
    # the same evaluation steps in every run; a rollback (and a diagnosis) on one outlier
    every = {"train.eval_every": eval_every(steps), "spikes.patience": PATIENCE}
    specs = [(spec_for(root, "clean", args.seed, steps, **every), clean_ds),
             (spec_for(root, "planted", data_seed, data_steps, **every), planted_ds),
             (spec_for(root, "faults", args.seed, steps, faults=faults, **every), clean_ds)]
    if data_seed != args.seed:  # the data run's reference: the clean corpus, the same seed
        specs.append((spec_for(root, "clean-data-seed", data_seed, data_steps, **every),
                      clean_ds))
    timeout = 300 + 0.5 * steps * max(1, args.jobs)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        runs = {r["name"]: r for r in pool.map(
            lambda j: run(root, j[1], j[0], timeout, ("--max-rollbacks", str(MAX_ROLLBACKS))),
            specs)}
    out = figures(runs, faults, data_incidents, planted, dirty)
    print(json.dumps({
        "figure": "spike_forensics", **out, "planted": report,
        "errors": {k: r["error"] for k, r in runs.items() if r["error"]},
        "inputs": {"model": {k[6:]: v for k, v in INPUTS.items() if k.startswith("model.")},
                   "params": runs["clean"]["params"], "corpus": CORPUS, "world_size": 1,
                   "world_size_note": "benchmarks/spikes.py's run() starts one rank",
                   "vocab_size": manifest.vocab_size, "steps": steps, "data_steps": data_steps,
                   "epoch_steps": epoch, "seed": args.seed, "data_seed": data_seed,
                   "incidents_per_kind": n, "planted_per_kind": per_kind, "faults": faults,
                   "gap": GAP, "min_step": MIN_STEP, "tail": TAIL, "rows_per_cursor": ROWS,
                   "spikes_patience": PATIENCE, "jobs": args.jobs, "quick": args.quick,
                   "max_rollbacks": MAX_ROLLBACKS,
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
