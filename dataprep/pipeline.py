"""prepare_dataset: corpus → cleaned, deduplicated, tokenized shards + DatasetManifest.

Stages (DESIGN §1, stage 1): list inputs (and read the quarantine files) → cache check →
clean (read, filter, MinHash; per work unit, in processes) → quarantine, dedup (exact, then
near) → split → tokenizer → tokenize (per work unit, in processes) → shards → commit. The
manifest is written last (DESIGN §3 commit point); `content_hash` of (input listing
metadata, DataConfig, the quarantined hashes) names the dataset directory, so a second call with the same inputs returns the committed manifest without
reading the corpus, and a retry after a crash reuses every finished work unit
(`dataprep.units`). The trainer reads the result only through `storage.dataset`.

Cleaned documents are held in memory between stages (fine for corpora up to a few GB).
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import structlog
from fsspec.spec import AbstractFileSystem
from tokenizers import Tokenizer

from common.errors import BadData, StorageUnavailable
from common.redact import redact
from dataprep.clean import Document, split_by_hash, tally
from dataprep.inputs import InputFile, content_hash, corpus_url, list_inputs
from dataprep.minhash import near_duplicates, shingles
from dataprep.provenance import document_index
from dataprep.tokens import cut_shards, eos_id, load_tokenizer, train_tokenizer, write_split
from dataprep.units import (
    CleanOutput,
    WorkDir,
    clean_unit,
    plan_units,
    run_jobs,
    tokenize_unit,
    tokenizer_threads,
    worker_count,
    worker_pool,
)
from spec import DataConfig
from storage.dataset import (
    MANIFEST,
    DatasetManifest,
    ShardInfo,
    commit_manifest,
    dataset_dir,
    load_manifest,
    manifest_url,
    token_dtype,
)
from storage.fs import join, resolve, storage_errors
from storage.quarantine import HASH_HEX, quarantine_key, quarantined_hashes

log = structlog.get_logger(__name__)

Progress = Callable[[str, dict[str, Any]], None]
# Stats that describe how a dataset was made, not what it is: they may differ between an
# interrupted-and-resumed run and an uninterrupted one with equal output.
PROVENANCE_STATS = ("seconds", "cpu_seconds", "resume")


class _Phases:
    """Times each phase, logs it, reports it to `progress`, and keeps every count."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, Any] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[dict[str, Any]]:
        counts: dict[str, Any] = {}
        start = time.perf_counter()
        yield counts
        self.seconds[name] = round(time.perf_counter() - start, 4)
        self.counts.update(counts)
        log.info("dataprep_phase_done", phase=name, seconds=self.seconds[name], **counts)
        self.report(name, counts)

    def report(self, name: str, counts: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress(name, dict(counts))


@contextmanager
def _durable(url: str) -> Iterator[None]:
    """An unreachable durable tier is retryable, not a data problem."""
    try:
        yield
    except storage_errors() as exc:
        raise StorageUnavailable(url, str(exc)) from exc


def prepare_dataset(data: DataConfig, durable_url: str, seed: int,
                    progress: Progress | None = None) -> tuple[str, DatasetManifest, bool]:
    """(manifest URL, manifest, cache_hit) of the dataset `data` describes.

    `seed` does not change the output: tokenizer training, MinHash and the hash split are
    deterministic, so runs that differ only in seed share one cached dataset.
    Raises BadData (non-retryable, naming the file and the fix) or StorageUnavailable.
    """
    phases = _Phases(progress)
    log.info("dataprep_started", corpus=data.corpus, durable=durable_url, seed=seed)
    with phases("list") as counts:
        in_fs, files = list_inputs(data)
        # read before the cache check: the key is the quarantine's content; an unreadable
        # file is BadData naming it (retrying would not make it readable)
        quarantine = quarantined_hashes(data.quarantine)
        key = content_hash(data, files, quarantine_key(quarantine) if quarantine else "")
        counts.update(files=len(files), bytes_in=sum(f.size for f in files),
                      quarantine_hashes=len(quarantine))
    url = manifest_url(durable_url, key)
    out_fs, out_dir = resolve(dataset_dir(durable_url, key))
    with _durable(durable_url):
        if out_fs.exists(join(out_dir, MANIFEST)):
            manifest = load_manifest(url)
            log.info("dataset_cache_hit", content_hash=key, manifest=url)
            phases.report("cache_hit", {"docs_out": manifest.stats.get("docs_out", 0)})
            return url, manifest, True
        work = WorkDir(out_fs, out_dir)
        try:
            manifest = _build(data, key, in_fs, files, work, out_fs, out_dir, phases,
                              quarantine)
        except BadData:  # deterministic: a retry would fail the same way, so keep nothing
            if out_fs.exists(out_dir):
                out_fs.rm(out_dir, recursive=True)
            raise
        work.remove()  # only after the commit: until then it is what a retry resumes from
    log.info("dataset_committed", content_hash=key, manifest=url,
             docs_out=manifest.stats["docs_out"], tokens_train=manifest.stats["tokens_train"],
             tokens_val=manifest.stats["tokens_val"], seconds=manifest.stats["seconds"]["total"],
             resume=manifest.stats["resume"])
    return url, manifest, False


def _build(data: DataConfig, key: str, in_fs: AbstractFileSystem, files: list[InputFile],
           work: WorkDir, out_fs: AbstractFileSystem, out_dir: str,
           phases: _Phases, quarantine: frozenset[str] = frozenset()) -> DatasetManifest:
    units = plan_units(files, data.unit_bytes)
    resume = {"units": len(units), "clean_reused": 0, "tokenize_reused": 0}
    workers = worker_count(data, len(units), sum(f.size for f in files), corpus_url(data.corpus))
    # One pool for both parallel phases; the serial phases between them (dedup, split,
    # tokenizer training) run here, training on a thread per core unless workers=1.
    log.info("dataprep_workers", workers=workers, units=len(units), configured=data.workers)
    with worker_pool(workers) as pool, tokenizer_threads(data.workers != 1):
        outputs = _clean_units(data, in_fs, units, work, pool, phases, resume)
        docs, unit_of = _dedup(data, outputs, phases, quarantine)
        with phases("split") as counts:
            train, val = split_by_hash(docs, data.val_fraction, data.corpus)
            counts.update(docs_train=len(train), docs_val=len(val))
        val_shas = {d.sha256 for d in val}
        with phases("tokenizer") as counts:
            tok, source = _tokenizer(data, train, work, phases)
            eos, vocab = eos_id(tok, source), tok.get_vocab_size()
            counts.update(vocab_size=vocab, eos_id=eos)
        tokens = _tokenize_units(tok, eos, token_dtype(vocab), docs, unit_of, val_shas,
                                 len(units), work, pool, phases, resume)
    out_fs.makedirs(out_dir, exist_ok=True)
    with out_fs.open(join(out_dir, "tokenizer.json"), "w") as f:
        f.write(tok.to_str())
    urls = {f.url for f in files}
    with phases("shards") as counts:
        shards: list[ShardInfo] = []
        # Each split's stream is its documents in `docs` order (units are contiguous there,
        # and split_by_hash keeps that order), so the index rows follow the same order.
        for split, split_docs in (("train", train), ("val", val)):
            written = write_split(out_fs, out_dir, split,
                                  cut_shards(_split_docs(tokens, split), data.shard_tokens),
                                  lambda s: phases.report("shard_written", _shard_counts(s)),
                                  document_index(split_docs, urls))
            counts[f"tokens_{split}"] = sum(s.tokens for s in written)
            counts[f"shards_{split}"] = len(written)
            shards += written
    cpu = {k: round(sum(o.cpu_s[k] for o in outputs), 4) for k in ("read", "clean", "hash")}
    cpu["encode"] = round(sum(float(t.get("cpu_s", 0.0)) for t in tokens), 4)
    # Timings cover every phase but the commit itself (the manifest cannot time its own write).
    # `source` is data.tokenizer.path when one was given: a URL, scrubbed like any record
    stats = {**phases.counts, "tokenizer": redact(source), "workers": workers, "resume": resume,
             "cpu_seconds": cpu,
             "seconds": {**phases.seconds, "total": round(sum(phases.seconds.values()), 4)}}
    manifest = DatasetManifest(content_hash=key, vocab_size=vocab, eos_id=eos,
                               dtype=token_dtype(vocab), shards=tuple(shards), stats=stats)
    with phases("commit"):
        commit_manifest(out_fs, out_dir, manifest)
    return manifest


def _clean_units(data: DataConfig, in_fs: AbstractFileSystem, units: list, work: WorkDir,
                 pool: ProcessPoolExecutor | None, phases: _Phases,
                 resume: dict[str, int]) -> list[CleanOutput]:
    """Every unit's clean output, in unit order: reused from the work dir or computed."""
    with phases("clean") as counts:
        outputs = {i: out for i in range(len(units)) if (out := work.load_clean(i))}
        resume["clean_reused"] = len(outputs)
        fs_arg = (in_fs,) if pool is None else ()  # children open their own filesystem

        def done(index: int, out: CleanOutput) -> None:
            work.save_clean(index, out)
            outputs[index] = out
            phases.report("unit_cleaned", {"unit": index, "done": len(outputs),
                                           "units": len(units)})

        run_jobs({i: (clean_unit, (units[i], data, *fs_arg))
                  for i in range(len(units)) if i not in outputs}, pool, done)
        counts["units"] = len(units)
    return [outputs[i] for i in range(len(units))]


def _dedup(data: DataConfig, outputs: list[CleanOutput], phases: _Phases,
           quarantine: frozenset[str] = frozenset()) -> tuple[list[Document], list[int]]:
    """Kept documents (first `max_documents` raw ones, filtered, quarantined ones dropped,
    exact- then near-deduped) with the unit each came from."""
    cap = data.max_documents or None
    counts_in: dict[str, int] = {"undecodable_files": 0}
    records, unit_of, sig_rows = [], [], []
    for unit, out in enumerate(outputs):
        counts_in["undecodable_files"] += out.counts.get("undecodable_files", 0)
        kept = 0
        for rec in out.records:
            if cap and len(records) >= cap:
                break
            records.append(rec)
            if rec.verdict is None:
                unit_of.append(unit)
                sig_rows.append(out.signatures[kept])
                kept += 1
    with phases("dedup") as counts:
        counts.update(counts_in, docs_in=len(records))
        docs = tally(records, counts)
        # the hash prefix the document index stores, as the quarantine lists it; every
        # copy of a quarantined text goes, before exact dedup could keep one
        keep = [i for i, d in enumerate(docs) if d.sha256[:HASH_HEX] not in quarantine]
        counts["dropped_quarantined"] = len(docs) - len(keep)
        before = len(keep)
        if data.dedup.exact:
            first = {docs[i].sha256: i for i in reversed(keep)}
            keep = sorted(first.values())
        counts["exact_dups"] = before - len(keep)
        near: list[int] = []
        if data.dedup.near and len(keep) > 1:
            sigs = np.stack([sig_rows[i] for i in keep])
            near = near_duplicates(sigs, lambda k: shingles(docs[keep[k]].text, data.dedup.ngram),
                                   data.dedup.threshold)
            dropped = set(near)
            keep = [k for n, k in enumerate(keep) if n not in dropped]
        counts["near_dups"] = len(near)
        counts["docs_out"] = len(keep)
    if not keep:
        raise BadData(data.corpus, _empty_problem(phases.counts, data),
                      "relax data.cleaning (min_chars, max_chars, the repetition and "
                      "non-text fractions), or point data.corpus at more (or different) text")
    return [docs[i] for i in keep], [unit_of[i] for i in keep]


def _tokenize_units(tok: Tokenizer, eos: int, dtype: str, docs: list[Document],
                    unit_of: list[int], val_shas: set[str], n_units: int, work: WorkDir,
                    pool: ProcessPoolExecutor | None, phases: _Phases,
                    resume: dict[str, int]) -> list[dict[str, np.ndarray]]:
    with phases("tokenize") as counts:
        texts: list[dict[str, list[str]]] = [{"train": [], "val": []} for _ in range(n_units)]
        for doc, unit in zip(docs, unit_of):
            texts[unit]["val" if doc.sha256 in val_shas else "train"].append(doc.text)
        results = {i: out for i in range(n_units) if (out := work.load_tokens(i))}
        resume["tokenize_reused"] = len(results)
        tok_json = tok.to_str()

        def done(index: int, arrays: dict[str, np.ndarray]) -> None:
            work.save_tokens(index, arrays)
            results[index] = arrays
            phases.report("unit_tokenized", {"unit": index, "done": len(results),
                                             "units": n_units})

        run_jobs({i: (tokenize_unit, (tok_json, eos, dtype, texts[i]))
                  for i in range(n_units) if i not in results}, pool, done)
        counts["units"] = n_units
    return [results[i] for i in range(n_units)]


def _split_docs(tokens: list[dict[str, np.ndarray]], split: str) -> Iterator[np.ndarray]:
    """The split's documents (ids + eos each) in unit order."""
    for arrays in tokens:
        ids, lens = arrays[f"{split}_ids"], arrays[f"{split}_lens"]
        yield from np.split(ids, np.cumsum(lens)[:-1]) if lens.size else ()


def _tokenizer(data: DataConfig, train: list[Document], work: WorkDir,
               phases: _Phases) -> tuple[Tokenizer, str]:
    """(tokenizer, where it came from): the given tokenizer.json, or one trained here
    (once: a retry reuses the one in the work dir)."""
    if data.tokenizer.path:
        return load_tokenizer(data.tokenizer.path), data.tokenizer.path
    saved = work.load("tokenizer")
    if saved is not None:
        return Tokenizer.from_str(saved[".json"].decode()), "trained"
    # Trained on train documents only, so nothing about val leaks into the vocabulary.
    tok = train_tokenizer([d.text for d in train], data.tokenizer.vocab_size,
                          tick=lambda s: phases.report("tokenizer_training",
                                                       {"seconds": round(s, 1)}))
    work.commit("tokenizer", {".json": tok.to_str().encode()})
    return tok, "trained"


def _shard_counts(shard: ShardInfo) -> dict[str, Any]:
    return {"split": shard.split, "path": shard.path, "tokens": shard.tokens}


def _empty_problem(counts: dict[str, Any], data: DataConfig) -> str:
    c = data.cleaning
    filters = ", ".join(f"{counts.get(k, 0)} {k}" for k in
                        ("dropped_non_text", "dropped_dup_lines", "dropped_dup_line_chars",
                         "dropped_top_ngram", "dropped_dup_ngram"))
    return (f"no documents left after cleaning ({counts.get('docs_in', 0)} read, "
            f"{counts.get('dropped_min_chars', 0)} dropped by min_chars={c.min_chars}, "
            f"{counts.get('dropped_max_chars', 0)} dropped by max_chars={c.max_chars}, "
            f"{filters}, {counts.get('dropped_quarantined', 0)} quarantined, "
            f"{counts.get('exact_dups', 0)} exact duplicates, "
            f"{counts.get('near_dups', 0)} near duplicates)")
