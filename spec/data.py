"""RunSpec's `data` section: where the corpus is and how data prep cleans, dedups and
tokenizes it (dataprep/). Stdlib only; re-exported by spec."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from spec.codec import STEPS, num
from spec.codec import positive as _positive
from spec.codec import require as _require


@dataclass(frozen=True, kw_only=True)
class CleaningConfig:
    """Per-document filters applied before dedup (each counted in the dataset manifest).

    The repetition thresholds are Gopher's (Rae et al. 2021, "Scaling Language Models",
    Appendix A Table A1), also used by RefinedWeb (Penedo et al. 2023, §G.1). A fraction
    of 1.0 disables that filter.
    """

    normalize: str = "NFC"  # Unicode normal form applied to every document
    min_chars: int = num(64, 1, 10**9)  # documents shorter than this are dropped
    max_chars: int = num(200_000, 1, 10**9)  # documents longer than this are dropped
    max_dup_line_fraction: float = num(0.30, 0, 1)  # share of lines that repeat an earlier line
    max_dup_line_char_fraction: float = num(0.20, 0, 1)  # share of characters in such lines
    # Most frequent word n-gram's share of characters, for n = 2, 3, 4.
    max_top_ngram_char_fraction: tuple[float, float, float] = num((0.20, 0.18, 0.16), 0, 1)
    # Share of characters in repeated word n-grams, for n = 5 .. 10.
    max_dup_ngram_char_fraction: tuple[float, float, float, float, float, float] = num(
        (0.15, 0.14, 0.13, 0.12, 0.11, 0.10), 0, 1)
    # Mostly-non-text documents: share of non-whitespace characters that are letters or
    # digits (0 disables). Source code sits around 0.7, binary dumps and tables far lower.
    min_alnum_fraction: float = num(0.5, 0, 1)

    def __post_init__(self) -> None:
        _require(self.normalize in ("NFC", "NFKC", "none"), "normalize",
                 f"unknown form {self.normalize!r}", "use NFC, NFKC or none")
        _positive(self, "min_chars", "max_chars")
        _require(self.max_chars >= self.min_chars, "max_chars", "is below min_chars",
                 "raise max_chars or lower min_chars")
        for name in ("max_dup_line_fraction", "max_dup_line_char_fraction",
                     "max_top_ngram_char_fraction", "max_dup_ngram_char_fraction",
                     "min_alnum_fraction"):
            values = getattr(self, name)
            for v in values if isinstance(values, tuple) else (values,):
                _require(0.0 <= v <= 1.0, name, f"must be a fraction in [0, 1], got {v}",
                         "use 1.0 to disable a max_* filter, 0.0 to disable min_alnum_fraction")


@dataclass(frozen=True, kw_only=True)
class DedupConfig:
    """Exact and MinHash-LSH near-duplicate removal; the first document of a cluster stays."""

    exact: bool = True  # drop documents whose normalised text hash was already seen
    near: bool = True  # drop documents whose word-shingle Jaccard to a kept one >= threshold
    # word n-gram Jaccard similarity counted as near-duplicate
    threshold: float = num(0.8, 0, 1, lo_open=True)
    num_perm: int = num(128, 16, 1024)  # MinHash permutations (signature length)
    ngram: int = num(5, 1, 32)  # words per shingle (5 as in RefinedWeb and BigCode near-dedup)

    def __post_init__(self) -> None:
        _require(0.0 < self.threshold <= 1.0, "threshold",
                 f"must be in (0, 1], got {self.threshold}", "use e.g. 0.8")
        _require(16 <= self.num_perm <= 1024, "num_perm",
                 f"must be in [16, 1024], got {self.num_perm}", "use e.g. 128")
        _require(1 <= self.ngram <= 32, "ngram", f"must be in [1, 32], got {self.ngram}",
                 "use e.g. 5")


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig:
    vocab_size: int = num(2048, 257, 1 << 20)  # byte-level BPE trained on the cleaned corpus
    path: str = ""  # an existing tokenizer.json (fsspec URL) instead of training one

    def __post_init__(self) -> None:
        _require(257 <= self.vocab_size <= 1 << 20, "vocab_size",
                 f"must be in [257, 1048576], got {self.vocab_size}",
                 "byte-level BPE needs at least 256 byte tokens plus specials")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the corpus is and how it becomes token shards."""

    # fsspec URL or glob; `stdlib:<glob>` means this Python's standard library sources.
    corpus: str = "stdlib:*.py"
    format: str = "auto"  # auto (by extension) | txt | jsonl | parquet
    text_field: str = "text"  # the text key of .jsonl records and the text column of .parquet
    max_documents: int = num(0, 0, STEPS)  # 0 = all; otherwise the first N documents in path order
    cleaning: CleaningConfig = field(default_factory=CleaningConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shard_tokens: int = num(1 << 20, 1, 1 << 34)  # tokens per shard file
    # share of documents (by hash) held out for validation
    val_fraction: float = num(0.05, 0, 0.5, lo_open=True, hi_open=True)
    workers: int = num(0, 0, 4096)  # processes for read/clean/hash/tokenize; 0 = every core
    unit_bytes: int = num(1 << 20, 1, 1 << 40)  # input bytes per work unit (unit of resume)
    # Quarantine files (runs/<run_id>/quarantine.jsonl of earlier runs, local paths or
    # URLs): every document whose cleaned text has a hash they list is dropped.
    quarantine: tuple[str, ...] = ()
    # added fields at their default: out of spec_hash (spec/run.py, without_added)
    ADDED: ClassVar[dict[str, Any]] = {"quarantine": []}

    def __post_init__(self) -> None:
        _require(bool(self.corpus.strip()), "corpus", "is empty",
                 "point it at a file, directory glob or fsspec URL of .txt/.jsonl/.parquet files")
        _require(self.format in ("auto", "txt", "jsonl", "parquet"), "format",
                 f"unknown format {self.format!r}", "use auto, txt, jsonl or parquet")
        _require(bool(self.text_field), "text_field", "is empty", "use e.g. text")
        _require(self.workers >= 0, "workers", "must be >= 0", "use 0 for every core")
        _positive(self, "unit_bytes")
        _require(self.max_documents >= 0, "max_documents", "must be >= 0", "use 0 for all")
        _positive(self, "shard_tokens")
        _require(0.0 < self.val_fraction < 0.5, "val_fraction",
                 f"must be in (0, 0.5), got {self.val_fraction}", "use e.g. 0.05")
        check_quarantine(self.quarantine)


QUARANTINE_FIX = ("list each run's quarantine file once, e.g. "
                  "s3://bucket/store/runs/<run_id>/quarantine.jsonl")


def check_quarantine(uris: tuple[str, ...]) -> None:
    """`data.quarantine`: non-empty `.jsonl` file names, no glob, each listed once."""
    seen: set[str] = set()
    for i, uri in enumerate(uris):
        name = f"quarantine[{i}]"
        _require(bool(uri.strip()), name, "is empty", QUARANTINE_FIX)
        _require(uri.lower().endswith(".jsonl"), name,
                 f"{uri!r} is not a .jsonl file", QUARANTINE_FIX)
        _require(not any(c in uri for c in "*?["), name, f"{uri!r} is a glob, not a file",
                 QUARANTINE_FIX)
        _require(uri not in seen, name, f"{uri!r} is listed twice",
                 "remove the repeated entry")
        seen.add(uri)
