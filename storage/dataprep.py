"""prepare_dataset: corpus → cleaned, deduplicated, tokenized shards + DatasetManifest.

Stages (DESIGN §1, stage 1): list inputs → cache check → read → clean → exact dedup →
split → tokenizer → shards → commit. The manifest is written last (DESIGN §3 commit
point); `content_hash` of (input listing metadata, DataConfig) names the dataset
directory, so a second call with the same inputs returns the committed manifest without
reading the corpus. The trainer reads the result only through `storage.dataset`.

Documents are held in memory between stages (fine for the demo and for corpora up to a
few GB); shards are written as they fill.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import structlog
from fsspec.spec import AbstractFileSystem
from tokenizers import Tokenizer

from ops.errors import BadData, StorageUnavailable
from ops.spec import DataConfig
from storage.dataprep_inputs import InputFile, content_hash, list_inputs, read_documents
from storage.dataprep_text import Document, clean_documents, dedup_exact, split_by_hash
from storage.dataprep_tokens import (cut_shards, encode_documents, eos_id, load_tokenizer,
                                     train_tokenizer, write_split)
from storage.dataset import (MANIFEST, DatasetManifest, ShardInfo, commit_manifest, dataset_dir,
                             load_manifest, manifest_url, token_dtype)
from storage.fs import join, resolve, storage_errors

log = structlog.get_logger(__name__)

Progress = Callable[[str, dict[str, Any]], None]


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

    `seed` does not change the output: tokenizer training and the hash split are
    deterministic, so runs that differ only in seed share one cached dataset.
    Raises BadData (non-retryable, naming the file and the fix) or StorageUnavailable.
    """
    phases = _Phases(progress)
    log.info("dataprep_started", corpus=data.corpus, durable=durable_url, seed=seed)
    with phases("list") as counts:
        in_fs, files = list_inputs(data)
        key = content_hash(data, files)
        counts.update(files=len(files), bytes_in=sum(f.size for f in files))
    url = manifest_url(durable_url, key)
    out_fs, out_dir = resolve(dataset_dir(durable_url, key))
    with _durable(durable_url):
        if out_fs.exists(join(out_dir, MANIFEST)):
            manifest = load_manifest(url)
            log.info("dataset_cache_hit", content_hash=key, manifest=url)
            phases.report("cache_hit", {"docs_out": manifest.stats.get("docs_out", 0)})
            return url, manifest, True

    train, val = _documents(data, in_fs, files, phases)
    with _durable(durable_url):
        manifest = _write_dataset(data, key, train, val, out_fs, out_dir, phases)
    log.info("dataset_committed", content_hash=key, manifest=url,
             docs_out=manifest.stats["docs_out"], tokens_train=manifest.stats["tokens_train"],
             tokens_val=manifest.stats["tokens_val"], seconds=manifest.stats["seconds"]["total"])
    return url, manifest, False


def _documents(data: DataConfig, in_fs: AbstractFileSystem, files: list[InputFile],
               phases: _Phases) -> tuple[list[Document], list[Document]]:
    """Read → clean → dedup → split: the (train, val) documents, in path order."""
    with phases("read") as counts:
        raw = read_documents(in_fs, files, data, counts)
    with phases("clean") as counts:
        docs = clean_documents(raw, data.cleaning, counts)
    with phases("dedup") as counts:
        docs = dedup_exact(docs, counts) if data.dedup.exact else docs
        counts["docs_out"] = len(docs)
    if not docs:
        raise BadData(data.corpus, _empty_problem(phases.counts, data),
                      "lower data.cleaning.min_chars, raise data.cleaning.max_chars, or point "
                      "data.corpus at more (or different) text")
    with phases("split") as counts:
        train, val = split_by_hash(docs, data.val_fraction, data.corpus)
        counts.update(docs_train=len(train), docs_val=len(val))
    return train, val


def _write_dataset(data: DataConfig, key: str, train: list[Document], val: list[Document],
                   out_fs: AbstractFileSystem, out_dir: str, phases: _Phases) -> DatasetManifest:
    """Tokenizer → shards → MANIFEST.json (last: the commit point)."""
    out_fs.makedirs(out_dir, exist_ok=True)
    with phases("tokenizer") as counts:
        tok, source = _tokenizer(data, train)
        eos, vocab = eos_id(tok, source), tok.get_vocab_size()
        with out_fs.open(join(out_dir, "tokenizer.json"), "w") as f:
            f.write(tok.to_str())
        counts.update(vocab_size=vocab, eos_id=eos)
    with phases("shards") as counts:
        shards: list[ShardInfo] = []
        for split, split_docs in (("train", train), ("val", val)):
            ids = encode_documents(tok, [d.text for d in split_docs], eos, token_dtype(vocab))
            written = write_split(out_fs, out_dir, split, cut_shards(ids, data.shard_tokens),
                                  lambda s: phases.report("shard_written", _shard_counts(s)))
            counts[f"tokens_{split}"] = sum(s.tokens for s in written)
            counts[f"shards_{split}"] = len(written)
            shards += written
    # Timings cover every phase but the commit itself (the manifest cannot time its own write).
    stats = {**phases.counts, "tokenizer": source,
             "seconds": {**phases.seconds, "total": round(sum(phases.seconds.values()), 4)}}
    manifest = DatasetManifest(content_hash=key, vocab_size=vocab, eos_id=eos,
                               dtype=token_dtype(vocab), shards=tuple(shards), stats=stats)
    with phases("commit"):
        commit_manifest(out_fs, out_dir, manifest)
    return manifest


def _tokenizer(data: DataConfig, train: list[Document]) -> tuple[Tokenizer, str]:
    """(tokenizer, where it came from): the given tokenizer.json, or one trained here."""
    if data.tokenizer.path:
        return load_tokenizer(data.tokenizer.path), data.tokenizer.path
    # Trained on train documents only, so nothing about val leaks into the vocabulary.
    return train_tokenizer([d.text for d in train], data.tokenizer.vocab_size), "trained"


def _shard_counts(shard: ShardInfo) -> dict[str, Any]:
    return {"split": shard.split, "path": shard.path, "tokens": shard.tokens}


def _empty_problem(counts: dict[str, Any], data: DataConfig) -> str:
    c = data.cleaning
    return (f"no documents left after cleaning ({counts.get('docs_in', 0)} read, "
            f"{counts.get('dropped_min_chars', 0)} dropped by min_chars={c.min_chars}, "
            f"{counts.get('dropped_max_chars', 0)} dropped by max_chars={c.max_chars}, "
            f"{counts.get('exact_dups', 0)} exact duplicates)")
