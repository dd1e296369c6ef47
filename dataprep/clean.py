"""Data prep, stages 3, 4 and 7: clean, exact-dedup and split documents. Pure functions.

Every filter counts what it did into the `counts` dict it is given; those counts become
the dataset manifest's stats, so a surprising dataset can be explained after the fact.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field

from common.errors import BadData
from dataprep.filters import FILTER_KEYS, quality_figures
from dataprep.inputs import RawDocument
from spec import CleaningConfig

# C0 and C1 control characters (Unicode category Cc) except \t and \n. \r goes too, so
# CRLF and LF files give the same text (and dedup as the same document).
CONTROL_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass(frozen=True, slots=True)
class Cleaned:
    """One raw document after cleaning: kept (`verdict` None) or dropped by a filter."""

    source: str
    text: str  # cleaned text; "" when dropped
    sha256: str  # of the cleaned text; "" when dropped
    verdict: str | None  # the stats key of the filter that dropped it
    normalized: bool
    stripped: bool
    # The quality figures computed on the way to the verdict (filters.FIGURE_NAMES keys).
    figures: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Document:
    source: str  # file URL, plus `:<line>` (jsonl) or `:<row>` (parquet)
    text: str  # cleaned
    sha256: str  # of the cleaned text: the identity used by dedup and the split
    # How cleaning treated it, for the document index (storage.provenance).
    normalized: bool = False
    stripped: bool = False
    figures: dict[str, float] = field(default_factory=dict)


def _bump(counts: dict[str, int], key: str, by: int = 1) -> None:
    counts[key] = counts.get(key, 0) + by


def clean_text(text: str, normalize: str) -> tuple[str, bool, bool]:
    """(cleaned text, changed by normalisation, changed by control-character stripping)."""
    normal = text if normalize == "none" else unicodedata.normalize(normalize, text)
    stripped = CONTROL_CHARS.sub("", normal)
    return stripped, normal != text, stripped != normal


def clean_one(doc: RawDocument, cfg: CleaningConfig) -> Cleaned:
    """Normalise, strip control characters, then length and quality filters."""
    text, normalized, stripped = clean_text(doc.text, cfg.normalize)
    figures: dict[str, float] = {}
    if len(text) < cfg.min_chars:
        verdict: str | None = "dropped_min_chars"
    elif len(text) > cfg.max_chars:
        verdict = "dropped_max_chars"
    else:
        verdict, figures = quality_figures(text, cfg)
    if verdict:
        return Cleaned(doc.source, "", "", verdict, normalized, stripped)
    return Cleaned(doc.source, text, hashlib.sha256(text.encode()).hexdigest(), None,
                   normalized, stripped, figures)


COUNT_KEYS = ("normalized", "control_stripped", "dropped_min_chars", "dropped_max_chars",
              *FILTER_KEYS)


def tally(records: list[Cleaned], counts: dict[str, int]) -> list[Document]:
    """Count every filter's effect into `counts`; the kept documents in order."""
    for key in COUNT_KEYS:
        counts.setdefault(key, 0)
    kept = []
    for rec in records:
        _bump(counts, "normalized", rec.normalized)
        _bump(counts, "control_stripped", rec.stripped)
        if rec.verdict:
            _bump(counts, rec.verdict)
        else:
            kept.append(Document(rec.source, rec.text, rec.sha256, rec.normalized,
                                 rec.stripped, rec.figures))
    return kept


def hash_unit(sha256: str) -> float:
    """A document's position in [0, 1): its split coordinate, independent of corpus order."""
    return int(sha256[:8], 16) / 2**32


def split_by_hash(docs: list[Document], val_fraction: float,
                  corpus: str) -> tuple[list[Document], list[Document]]:
    """(train, val) by document hash, so identical texts always land in the same split.

    A document is held out when its hash unit is below `val_fraction`. Small corpora can
    miss either side by chance; then the lowest-hash text moves to val (or the highest
    to train), keeping both splits non-empty and disjoint.
    """
    distinct = sorted({d.sha256 for d in docs}, key=hash_unit)
    if len(distinct) < 2:
        raise BadData(corpus, f"only {len(distinct)} distinct document(s) left after cleaning; "
                      "a train/val split needs at least 2",
                      "add documents to data.corpus or relax data.cleaning")
    val = {h for h in distinct if hash_unit(h) < val_fraction} or {distinct[0]}
    if len(val) == len(distinct):
        val.discard(distinct[-1])
    return [d for d in docs if d.sha256 not in val], [d for d in docs if d.sha256 in val]
