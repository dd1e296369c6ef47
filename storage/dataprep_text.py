"""Data prep, stages 3, 4 and 7: clean, exact-dedup and split documents. Pure functions.

Every filter counts what it did into the `counts` dict it is given; those counts become
the dataset manifest's stats, so a surprising dataset can be explained after the fact.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

from ops.errors import BadData
from ops.spec import CleaningConfig
from storage.dataprep_inputs import RawDocument

# C0 and C1 control characters (Unicode category Cc) except \t and \n. \r goes too, so
# CRLF and LF files give the same text (and dedup as the same document).
CONTROL_CHARS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@dataclass(frozen=True, slots=True)
class Document:
    source: str
    text: str  # cleaned
    sha256: str  # of the cleaned text: the identity used by dedup and the split


def _bump(counts: dict[str, int], key: str, by: int = 1) -> None:
    counts[key] = counts.get(key, 0) + by


def clean_text(text: str, normalize: str) -> tuple[str, bool, bool]:
    """(cleaned text, changed by normalisation, changed by control-character stripping)."""
    normal = text if normalize == "none" else unicodedata.normalize(normalize, text)
    stripped = CONTROL_CHARS.sub("", normal)
    return stripped, normal != text, stripped != normal


def clean_documents(raw: list[RawDocument], cfg: CleaningConfig,
                    counts: dict[str, int]) -> list[Document]:
    """Normalise, strip control characters, drop by length (counts every filter)."""
    kept = []
    for doc in raw:
        text, normalized, stripped = clean_text(doc.text, cfg.normalize)
        _bump(counts, "normalized", normalized)
        _bump(counts, "control_stripped", stripped)
        if len(text) < cfg.min_chars:
            _bump(counts, "dropped_min_chars")
        elif len(text) > cfg.max_chars:
            _bump(counts, "dropped_max_chars")
        else:
            kept.append(Document(doc.source, text, hashlib.sha256(text.encode()).hexdigest()))
    for key in ("normalized", "control_stripped", "dropped_min_chars", "dropped_max_chars"):
        counts.setdefault(key, 0)
    return kept


def dedup_exact(docs: list[Document], counts: dict[str, int]) -> list[Document]:
    """Keep the first document of each cleaned-text hash; count the rest as `exact_dups`."""
    seen: set[str] = set()
    kept = []
    for doc in docs:
        if doc.sha256 not in seen:
            seen.add(doc.sha256)
            kept.append(doc)
    counts["exact_dups"] = len(docs) - len(kept)
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
