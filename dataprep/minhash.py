"""Near-duplicate detection: MinHash signatures, LSH banding, exact-Jaccard verification.

MinHash (Broder 1997) estimates the Jaccard similarity of two documents' word-shingle sets;
LSH banding (Leskovec, Rajaraman & Ullman, *Mining of Massive Datasets* §3.4) makes a pair
a candidate when all `rows` values of any of `bands` bands agree, i.e. with probability
1 - (1 - J**rows)**bands. Bands and rows are chosen so a pair *at* the threshold is a
candidate with probability >= 99 % (`lsh_params`); every candidate is then verified with
the exact Jaccard of its shingle sets, so the threshold is crisp: pairs at or above it
are merged, pairs below it never are. Clusters are the connected components of verified
pairs (union-find), and the first document of a cluster in corpus order is kept —
as in BigCode's near-dedup and RefinedWeb's MinHash stage (5-gram shingles).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from dataprep.filters import ngram_hashes, word_hashes

SEED = 0x5EED  # fixed, not the run seed: the dataset must not depend on `RunSpec.seed`
MISS_AT_THRESHOLD = 0.01  # accepted chance that a pair exactly at the threshold is missed
EMPTY = np.iinfo(np.uint32).max


def permutations(num_perm: int) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) of the multiply-shift hash family h(x) = ((a*x + b) mod 2**64) >> 32."""
    rng = np.random.default_rng(SEED)
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    return a, b


def shingles(text: str, n: int) -> np.ndarray:
    """Distinct hashes of the lower-cased word n-grams (the whole text if shorter)."""
    words = text.lower().split()
    hashes = word_hashes(words)
    grams = ngram_hashes(hashes, min(n, len(words))) if words else hashes
    return np.unique(grams)


def signature(shingle_set: np.ndarray, a: np.ndarray, b: np.ndarray,
              chunk: int = 4096) -> np.ndarray:
    """MinHash signature (uint32 per permutation); all EMPTY for an empty set."""
    sig = np.full(a.size, EMPTY, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for lo in range(0, shingle_set.size, chunk):
            x = shingle_set[lo:lo + chunk, None]
            values = ((x * a[None, :] + b[None, :]) >> np.uint64(32)).astype(np.uint32)
            np.minimum(sig, values.min(axis=0), out=sig)
    return sig


def candidate_probability(jaccard: float, bands: int, rows: int) -> float:
    return 1.0 - (1.0 - jaccard ** rows) ** bands


def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows): the most selective banding that still finds a pair at the threshold
    with probability >= 1 - MISS_AT_THRESHOLD (fewest false candidates to verify)."""
    best = (num_perm, 1)
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        if candidate_probability(threshold, bands, rows) >= 1 - MISS_AT_THRESHOLD:
            best = (bands, rows)
    return best


def jaccard(x: np.ndarray, y: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted, distinct hash arrays."""
    if x.size == 0 and y.size == 0:
        return 1.0
    inter = np.intersect1d(x, y, assume_unique=True).size
    return inter / (x.size + y.size - inter)


def candidate_pairs(signatures: np.ndarray, bands: int, rows: int) -> set[tuple[int, int]]:
    """Pairs (i < j) whose signatures agree on every row of at least one band."""
    pairs: set[tuple[int, int]] = set()
    for band in range(bands):
        keys = signatures[:, band * rows:(band + 1) * rows]
        buckets: dict[bytes, list[int]] = {}
        for i, key in enumerate(keys):
            buckets.setdefault(key.tobytes(), []).append(i)
        for members in buckets.values():
            for k, i in enumerate(members):
                pairs.update((i, j) for j in members[k + 1:])
    return pairs


def _root(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def near_duplicates(signatures: np.ndarray, shingles_of: Callable[[int], np.ndarray],
                    threshold: float) -> list[int]:
    """Indices to drop: every member of a near-duplicate cluster but its first.

    `signatures` is (docs, num_perm); `shingles_of(i)` gives document i's shingle set to
    verify a candidate pair exactly (computed only for documents in some candidate pair).
    """
    n = signatures.shape[0]
    if n < 2:
        return []
    bands, rows = lsh_params(threshold, signatures.shape[1])
    parent = list(range(n))
    cache: dict[int, np.ndarray] = {}

    def sets(i: int) -> np.ndarray:
        if i not in cache:
            cache[i] = shingles_of(i)
        return cache[i]

    for i, j in sorted(candidate_pairs(signatures, bands, rows)):
        ri, rj = _root(parent, i), _root(parent, j)
        if ri != rj and jaccard(sets(i), sets(j)) >= threshold:
            parent[max(ri, rj)] = min(ri, rj)  # the earliest document stays the root
    return [i for i in range(n) if _root(parent, i) != i]
