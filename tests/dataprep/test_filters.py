"""Quality filters (Gopher repetition, non-text) and MinHash-LSH near-dedup on crafted text."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import BadConfig
from dataprep.filters import (
    dup_line_fractions,
    dup_ngram_char_fraction,
    quality_verdict,
    top_ngram_char_fraction,
    word_hashes,
)
from dataprep.minhash import (
    candidate_probability,
    jaccard,
    lsh_params,
    near_duplicates,
    permutations,
    shingles,
    signature,
)
from dataprep.pipeline import prepare_dataset
from spec import CleaningConfig, DedupConfig
from tests.dataprep.test_pipeline import TEXTS, all_texts, config, write_txt


def _arrays(text: str) -> tuple[np.ndarray, np.ndarray]:
    words = text.split()
    return word_hashes(words), np.array([len(w) for w in words])


def prose(seed: int, n: int = 120) -> str:
    """n distinct words in lines of 12: passes every quality filter."""
    words = [f"w{seed}x{i}" for i in range(n)]
    return "\n".join(" ".join(words[i:i + 12]) for i in range(0, n, 12))


# Each text fails exactly the filter named, and would pass with that filter disabled.
FAILS = {
    "dropped_non_text": "=+=+ |--| ### " * 20 + "ok",
    "dropped_dup_lines": "\n".join([prose(1, 60)] + ["same repeated line"] * 4),
    "dropped_dup_line_chars": "\n".join(
        [f"short line {i}" for i in range(12)] + ["a long line " + prose(2, 30)] * 2),
    "dropped_top_ngram": " ".join(f"the cat w{i}" for i in range(60)),
    "dropped_dup_ngram": " ".join([prose(3, 30)] + [" ".join(f"r{i}" for i in range(12))] * 2),
}
OFF = {"min_alnum_fraction": 0.0, "max_dup_line_fraction": 1.0,
       "max_dup_line_char_fraction": 1.0, "max_top_ngram_char_fraction": (1.0,) * 3,
       "max_dup_ngram_char_fraction": (1.0,) * 6}
ONLY = {  # the default threshold of just this filter
    "dropped_non_text": {"min_alnum_fraction": 0.5},
    "dropped_dup_lines": {"max_dup_line_fraction": 0.3},
    "dropped_dup_line_chars": {"max_dup_line_char_fraction": 0.2},
    "dropped_top_ngram": {"max_top_ngram_char_fraction": (0.2, 0.18, 0.16)},
    "dropped_dup_ngram": {"max_dup_ngram_char_fraction": (0.15, 0.14, 0.13, 0.12, 0.11, 0.1)},
}


def test_repetition_measures_match_hand_counts():
    assert dup_line_fractions("a\nb\na\na\n\n") == (0.5, 2 / 4)  # blank lines ignored
    # "ab" occurs 3 times in a b a b a b: 3 * 2 chars of 6.
    assert top_ngram_char_fraction(*_arrays("a b a b a b"), 2) == 1.0
    assert top_ngram_char_fraction(*_arrays("a b c d"), 2) == 0.0  # nothing repeats
    # The second "a b c d e" covers 5 of 10 words; first occurrences do not count.
    assert dup_ngram_char_fraction(*_arrays("a b c d e a b c d e"), 5) == 0.5
    assert dup_ngram_char_fraction(*_arrays("a b c d e f g h i j"), 5) == 0.0


@pytest.mark.parametrize("expected", sorted(FAILS))
def test_each_quality_filter_alone_drops_its_text_and_clean_prose_passes_them_all(expected):
    text = FAILS[expected]
    assert quality_verdict(prose(9), CleaningConfig()) is None
    assert quality_verdict(text, CleaningConfig()) == expected
    assert quality_verdict(text, CleaningConfig(**{**OFF, **ONLY[expected]})) == expected
    assert quality_verdict(text, CleaningConfig(**OFF)) is None


def test_quality_filters_are_counted_in_the_manifest(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS[:6] + [FAILS[k] for k in sorted(FAILS)])
    url, man, _ = prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1)
    assert {k: man.stats[k] for k in FAILS} == {k: 1 for k in FAILS}
    assert man.stats["docs_out"] == 6 and sorted(all_texts(url)) == sorted(TEXTS[:6])


def test_cleaning_fractions_outside_zero_one_are_bad_config():
    with pytest.raises(BadConfig) as err:
        CleaningConfig(max_top_ngram_char_fraction=(0.2, 1.5, 0.1))
    assert err.value.field == "max_top_ngram_char_fraction" and "1.5" in err.value.problem


def test_lsh_bands_find_a_pair_at_the_threshold_with_99_percent_probability():
    for threshold, num_perm in ((0.8, 128), (0.5, 64), (0.95, 256)):
        bands, rows = lsh_params(threshold, num_perm)
        assert bands * rows <= num_perm
        assert candidate_probability(threshold, bands, rows) >= 0.99
        # ... and it is the most selective such choice (one more row would miss more).
        assert candidate_probability(threshold, num_perm // (rows + 1), rows + 1) < 0.99
    assert lsh_params(0.8, 128) == (21, 6)


def variant(base: list[str], changed: int) -> str:
    """`base` with `changed` words (spread out) replaced."""
    words = list(base)
    for k in range(changed):
        words[10 + k * 9] = f"changed{k}"
    return " ".join(words)


BASE = [f"tok{i}" for i in range(150)]


def test_minhash_signature_agreement_estimates_jaccard():
    a, b = permutations(256)
    x, y = shingles(" ".join(BASE), 5), shingles(variant(BASE, 4), 5)
    estimate = float((signature(x, a, b) == signature(y, a, b)).mean())
    assert abs(estimate - jaccard(x, y)) < 0.08


@pytest.mark.parametrize("changed", [1, 3, 6])
def test_near_duplicates_just_above_the_threshold_merge_and_just_below_do_not(changed):
    one, two = " ".join(BASE), variant(BASE, changed)
    sets = [shingles(one, 5), shingles(two, 5)]
    j = jaccard(*sets)
    a, b = permutations(128)
    sigs = np.stack([signature(s, a, b) for s in sets])
    assert near_duplicates(sigs, sets.__getitem__, j - 0.005) == [1]  # the later one goes
    assert near_duplicates(sigs, sets.__getitem__, j + 0.005) == []


def test_near_dedup_in_the_pipeline_keeps_the_first_of_each_cluster(tmp_path):
    base = " ".join(BASE)
    close = variant(BASE, 1)  # Jaccard ~0.94 to base
    far = variant(BASE, 12)  # Jaccard ~0.5
    assert jaccard(shingles(base, 5), shingles(close, 5)) > 0.9
    corpus = write_txt(tmp_path / "c", TEXTS[:6] + [base, close, far])
    url, man, _ = prepare_dataset(config(corpus, dedup=DedupConfig(threshold=0.9)),
                                  str(tmp_path / "store"), seed=1)
    assert (man.stats["exact_dups"], man.stats["near_dups"], man.stats["docs_out"]) == (0, 1, 8)
    texts = all_texts(url)
    assert base in texts and far in texts and close not in texts
    _, off, _ = prepare_dataset(config(corpus, dedup=DedupConfig(near=False)),
                                str(tmp_path / "store"), seed=1)
    assert (off.stats["near_dups"], off.stats["docs_out"]) == (0, 9)
