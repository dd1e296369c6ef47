"""prepare_dataset on crafted tiny corpora: filters, dedup, formats, errors, split, shards,
cache."""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import dataprep.pipeline as dataprep
from common.errors import BadData
from dataprep.clean import Document, hash_unit, split_by_hash
from dataprep.pipeline import prepare_dataset
from dataprep.tokens import cut_shards
from spec import CleaningConfig, DataConfig, DedupConfig, TokenizerConfig
from storage.dataset import load_manifest, read_split, tokenizer_path
from storage.fs import resolve

# Distinct, varied texts well above the test min_chars; a few need every byte-level trick.
TEXTS = [f"document {i}: " + " ".join(f"word{i * 7 + j}" for j in range(12)) for i in range(24)]
TRICKY = [
    "  leading spaces, trailing tab\t\nand a second line\n",
    "unicode: naïve café — 日本語テキスト, emoji 🚀🧪, maths ∑∫√",
    "a document that mentions <|endoftext|> in the middle of its text",
]


# Repetition and non-text filters off: for tests about something else on repetitive text.
NO_QUALITY = dict(max_dup_line_fraction=1.0, max_dup_line_char_fraction=1.0,
                  max_top_ngram_char_fraction=(1.0,) * 3, max_dup_ngram_char_fraction=(1.0,) * 6,
                  min_alnum_fraction=0.0)


def config(corpus: Path | str, **kw) -> DataConfig:
    """Small, fast defaults: short docs allowed, tiny vocab, small shards."""
    kw.setdefault("cleaning", CleaningConfig(min_chars=8, max_chars=10_000))
    kw.setdefault("tokenizer", TokenizerConfig(vocab_size=300))
    kw.setdefault("shard_tokens", 4096)
    kw.setdefault("val_fraction", 0.25)
    return DataConfig(corpus=str(corpus), **kw)


def write_txt(directory: Path, texts: list[str], encoding: str = "utf-8") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, text in enumerate(texts):
        (directory / f"doc{i:03d}.txt").write_bytes(text.encode(encoding))
    return directory


def split_texts(url: str, split: str) -> list[str]:
    """Decode a split back into documents using only the manifest, doc_starts and eos."""
    man = load_manifest(url)
    tokens, starts = read_split(url, split)
    fs, path = resolve(tokenizer_path(url))
    tok = Tokenizer.from_str(fs.cat_file(path).decode())
    ends = [*starts[1:].tolist(), tokens.size]
    texts = []
    for a, b in zip(starts.tolist(), ends):
        assert tokens[b - 1] == man.eos_id  # every document ends with eos
        assert man.eos_id not in tokens[a:b - 1]  # and eos appears nowhere else
        texts.append(tok.decode(tokens[a:b - 1].tolist(), skip_special_tokens=False))
    return texts


def all_texts(url: str) -> list[str]:
    return split_texts(url, "train") + split_texts(url, "val")


def test_length_filters_drop_and_count_what_they_should(tmp_path):
    short, long = ["tiny", "abc"], ["x" * 500]
    corpus = write_txt(tmp_path / "c", TEXTS[:6] + short + long)
    data = config(corpus, cleaning=CleaningConfig(min_chars=8, max_chars=400))
    url, man, hit = prepare_dataset(data, str(tmp_path / "store"), seed=1)
    assert not hit
    assert (man.stats["docs_in"], man.stats["dropped_min_chars"],
            man.stats["dropped_max_chars"], man.stats["docs_out"]) == (9, 2, 1, 6)
    assert sorted(all_texts(url)) == sorted(TEXTS[:6])


def test_control_characters_are_stripped_except_newline_and_tab(tmp_path):
    dirty = "keep\ttabs\nand newlines\r\n but\x00 not\x07 these\x1b[0m\x85 controls"
    corpus = write_txt(tmp_path / "c", TEXTS[:4] + [dirty])
    url, man, _ = prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1)
    assert man.stats["control_stripped"] == 1
    assert "keep\ttabs\nand newlines\n but not these[0m controls" in all_texts(url)


def test_normalisation_equivalent_texts_count_as_exact_duplicates(tmp_path):
    nfc = "café crème brûlée, déjà vu — naïve résumé"
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfc != nfd
    corpus = write_txt(tmp_path / "c", TEXTS[:4] + [nfc, nfd, TEXTS[0]])
    url, man, _ = prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1)
    assert man.stats["exact_dups"] == 2  # the NFD copy and the byte-identical repeat
    assert man.stats["normalized"] == 1
    assert sorted(all_texts(url)) == sorted(TEXTS[:4] + [nfc])
    # Without normalisation the two spellings are different documents.
    off = config(corpus, cleaning=CleaningConfig(min_chars=8, max_chars=10_000, normalize="none"))
    _, man_off, _ = prepare_dataset(off, str(tmp_path / "store"), seed=1)
    assert man_off.stats["exact_dups"] == 1


def test_exact_dedup_can_be_turned_off(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS[:4] + [TEXTS[1]])
    data = config(corpus, dedup=DedupConfig(exact=False, near=False))
    url, man, _ = prepare_dataset(data, str(tmp_path / "store"), seed=1)
    assert man.stats["docs_out"] == 5
    assert all_texts(url).count(TEXTS[1]) == 2


def test_jsonl_text_field_gives_one_document_per_record(tmp_path):
    records = [{"id": i, "content": t} for i, t in enumerate(TEXTS[:8])]
    (tmp_path / "c").mkdir()
    lines = [json.dumps(r) for r in records]
    (tmp_path / "c" / "a.jsonl").write_text("\n".join(lines[:5]) + "\n\n")  # blank lines skipped
    (tmp_path / "c" / "b.jsonl").write_text("\n".join(lines[5:]))
    url, man, _ = prepare_dataset(config(tmp_path / "c", text_field="content"),
                                  str(tmp_path / "store"), seed=1)
    assert (man.stats["files"], man.stats["docs_in"]) == (2, 8)
    assert sorted(all_texts(url)) == sorted(TEXTS[:8])


def test_max_documents_caps_jsonl_records_in_path_order(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS[3:9]))
    (tmp_path / "c" / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS[:3]))
    url, man, _ = prepare_dataset(config(tmp_path / "c", max_documents=5),
                                  str(tmp_path / "store"), seed=1)
    assert man.stats["docs_in"] == 5
    assert sorted(all_texts(url)) == sorted(TEXTS[:5])


def test_jsonl_without_the_text_field_is_bad_data_naming_file_line_and_field(tmp_path):
    (tmp_path / "c").mkdir()
    bad = tmp_path / "c" / "data.jsonl"
    bad.write_text(json.dumps({"text": TEXTS[0]}) + "\n" + json.dumps({"body": TEXTS[1]}) + "\n")
    with pytest.raises(BadData) as err:
        prepare_dataset(config(bad), str(tmp_path / "store"), seed=1)
    assert str(bad) in err.value.path
    assert "line 2" in err.value.problem and "'text'" in err.value.problem
    assert "body" in err.value.problem  # shows which fields the record does have
    assert "data.text_field" in err.value.fix


def test_corpus_empty_after_cleaning_is_bad_data_with_the_counts(tmp_path):
    corpus = write_txt(tmp_path / "c", ["short", "tiny", "x" * 50])
    data = config(corpus, cleaning=CleaningConfig(min_chars=10, max_chars=20))
    with pytest.raises(BadData) as err:
        prepare_dataset(data, str(tmp_path / "store"), seed=1)
    assert err.value.path == str(corpus)
    assert ("no documents left after cleaning (3 read, 2 dropped by min_chars=10"
            in err.value.problem)
    assert "1 dropped by max_chars=20" in err.value.problem
    assert "min_chars" in err.value.fix
    leftovers = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert leftovers == []  # nothing half-written, no work units left behind


def test_nonexistent_corpus_is_bad_data_naming_the_path(tmp_path):
    missing = tmp_path / "nope" / "*.txt"
    with pytest.raises(BadData) as err:
        prepare_dataset(config(missing), str(tmp_path / "store"), seed=1)
    assert err.value.path == str(missing) and str(missing) in err.value.problem
    assert "data.corpus" in err.value.fix


def test_unreadable_file_in_corpus_is_bad_data_naming_it(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS[:3])
    os.symlink(tmp_path / "gone.txt", corpus / "broken.txt")  # dangling: cannot be read
    with pytest.raises(BadData) as err:
        prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1)
    assert "broken.txt" in err.value.path and "not a readable file" in err.value.problem


def test_unknown_filesystem_protocol_is_bad_data_not_retryable(tmp_path):
    with pytest.raises(BadData) as err:
        prepare_dataset(config("nosuchfs://bucket/*.txt"), str(tmp_path / "store"), seed=1)
    assert "nosuchfs" in err.value.problem and not err.value.retryable


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS[:4])
    (corpus / "latin1.txt").write_bytes("caf\xe9 au lait, s'il vous pla\xeet".encode("latin-1"))
    url, man, _ = prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1)
    assert man.stats["undecodable_files"] == 1
    assert "caf\ufffd au lait, s'il vous pla\ufffdt" in all_texts(url)


def test_split_puts_no_document_in_both_train_and_val(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS)
    url, man, _ = prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1)
    train, val = split_texts(url, "train"), split_texts(url, "val")
    assert train and val
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(TEXTS)
    assert (man.stats["docs_train"], man.stats["docs_val"]) == (len(train), len(val))


def _doc(text: str) -> Document:
    return Document("x", text, hashlib.sha256(text.encode()).hexdigest())


def test_split_holds_out_at_least_one_document_even_for_a_tiny_fraction():
    docs = [_doc(t) for t in TEXTS[:3]]
    train, val = split_by_hash(docs, 1e-9, "corpus")
    assert len(val) == 1 and len(train) == 2
    with pytest.raises(BadData) as err:  # identical texts cannot be split without overlap
        split_by_hash([_doc(TEXTS[0]), _doc(TEXTS[0])], 0.1, "corpus")
    assert err.value.path == "corpus" and "at least 2" in err.value.problem


def test_split_keeps_at_least_one_training_document_when_every_hash_falls_in_val():
    docs = [_doc(t) for t in TEXTS[:3]]
    train, val = split_by_hash(docs, 1.0, "corpus")
    assert len(train) == 1 and len(val) == 2


def test_tokenizer_is_trained_on_train_documents_only(tmp_path):
    marker = next(t for t in (f"zqxjv{i} " * 60 for i in range(500))
                  if hash_unit(_doc(t).sha256) < 0.25)  # a text the split holds out
    corpus = write_txt(tmp_path / "c", TEXTS[:8] + [marker])
    data = config(corpus, tokenizer=TokenizerConfig(vocab_size=2000),
                  cleaning=CleaningConfig(min_chars=8, max_chars=10_000, **NO_QUALITY))
    url, _, _ = prepare_dataset(data, str(tmp_path / "store"), seed=1)
    assert marker in split_texts(url, "val")
    vocab = Tokenizer.from_file(tokenizer_path(url)).get_vocab()
    assert any("word" in token for token in vocab)  # train text did produce merges
    assert not any("zq" in token for token in vocab)  # the held-out text did not


def test_cut_shards_keeps_document_starts_of_the_shard_they_begin_in():
    docs = [np.arange(n, dtype=np.uint16) for n in (3, 6, 1, 2)]  # concat length 12
    shards = list(cut_shards(docs, 5))
    assert [s[0].tolist() for s in shards] == [[0, 1, 2, 0, 1], [2, 3, 4, 5, 0], [0, 1]]
    assert [s[1].tolist() for s in shards] == [[0, 3], [4], [0]]
    # A document longer than two shards: the middle shard has no document start at all.
    shards = list(cut_shards([np.arange(2, dtype=np.uint16), np.arange(12, dtype=np.uint16)], 5))
    assert [s[0].size for s in shards] == [5, 5, 4]
    assert [s[1].tolist() for s in shards] == [[0, 2], [], []]


def test_shards_round_trip_every_document_across_shard_boundaries(tmp_path):
    texts = TEXTS[:12] + TRICKY
    corpus = write_txt(tmp_path / "c", texts)
    data = config(corpus, shard_tokens=64)  # far smaller than the corpus: many cuts
    url, man, _ = prepare_dataset(data, str(tmp_path / "store"), seed=1)
    assert len(man.split_shards("train")) > 3
    assert man.tokens("train") == man.stats["tokens_train"]
    assert sorted(all_texts(url)) == sorted(texts)
    # The literal "<|endoftext|>" inside a text is ordinary bytes, not a document boundary.
    assert sum(len(split_texts(url, s)) for s in ("train", "val")) == len(texts)


def test_second_call_is_a_cache_hit_without_reading_the_corpus(tmp_path, monkeypatch):
    corpus = write_txt(tmp_path / "c", TEXTS[:8])
    store = str(tmp_path / "store")
    url, man, hit = prepare_dataset(config(corpus), store, seed=1)
    assert not hit

    def must_not_read(*args, **kwargs):
        raise AssertionError("the corpus was read on a cache hit")

    monkeypatch.setattr(dataprep, "clean_unit", must_not_read)
    phases: list[str] = []
    url2, man2, hit2 = prepare_dataset(config(corpus), store, seed=2,
                                       progress=lambda phase, counts: phases.append(phase))
    assert (url2, man2, hit2) == (url, man, True)
    assert phases == ["list", "cache_hit"]


def test_changing_the_config_or_an_input_changes_the_content_hash(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS[:8])
    store = str(tmp_path / "store")
    _, base, _ = prepare_dataset(config(corpus), store, seed=1)
    _, other_cfg, hit = prepare_dataset(config(corpus, val_fraction=0.3), store, seed=1)
    assert not hit and other_cfg.content_hash != base.content_hash
    (corpus / "doc000.txt").write_text(TEXTS[0] + " edited")
    _, edited, hit = prepare_dataset(config(corpus), store, seed=1)
    assert not hit and edited.content_hash not in (base.content_hash, other_cfg.content_hash)


def test_progress_reports_every_phase_in_order(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS[:8])
    seen: list[tuple[str, dict]] = []
    _, man, _ = prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1,
                                progress=lambda phase, counts: seen.append((phase, counts)))
    phases = [p for p, _ in seen if p not in ("shard_written", "unit_cleaned", "unit_tokenized")]
    assert phases == ["list", "clean", "dedup", "split", "tokenizer", "tokenize", "shards",
                      "commit"]
    assert dict(seen)["dedup"]["docs_in"] == 8
    assert ("unit_cleaned", {"unit": 0, "done": 1, "units": 1}) in seen
    assert set(man.stats["seconds"]) == set(phases) - {"commit"} | {"total"}


def test_given_tokenizer_path_is_used_instead_of_training(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS[:8])
    first_url, first, _ = prepare_dataset(config(corpus), str(tmp_path / "a"), seed=1)
    given = tokenizer_path(first_url)
    data = config(corpus, tokenizer=TokenizerConfig(vocab_size=5000, path=given))
    url, man, _ = prepare_dataset(data, str(tmp_path / "b"), seed=1)
    assert man.stats["tokenizer"] == given
    assert man.vocab_size == first.vocab_size < 5000
    assert sorted(all_texts(url)) == sorted(TEXTS[:8])


def test_tokenizer_without_end_of_text_token_is_bad_data(tmp_path):
    from tokenizers import Tokenizer as Tok
    from tokenizers import models
    plain = tmp_path / "plain.json"
    Tok(models.BPE()).save(str(plain))
    corpus = write_txt(tmp_path / "c", TEXTS[:4])
    data = config(corpus, tokenizer=TokenizerConfig(path=str(plain)))
    with pytest.raises(BadData) as err:
        prepare_dataset(data, str(tmp_path / "store"), seed=1)
    assert err.value.path == str(plain) and "<|endoftext|>" in err.value.problem


def test_durable_tier_can_be_any_fsspec_url(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS[:8])
    url, man, _ = prepare_dataset(config(corpus), "memory://dataprep-test", seed=1)
    assert url.startswith("memory://") and sorted(all_texts(url)) == sorted(TEXTS[:8])
    assert prepare_dataset(config(corpus), "memory://dataprep-test", seed=1)[2] is True


def test_stdlib_default_corpus_prepares_a_dataset(tmp_path):
    data = DataConfig(max_documents=30, tokenizer=TokenizerConfig(vocab_size=512))
    assert data.corpus.startswith("stdlib:")
    url, man, hit = prepare_dataset(data, str(tmp_path / "store"), seed=1)
    assert not hit and man.stats["files"] == 30 and man.stats["docs_in"] == 30
    assert man.vocab_size == 512 and man.dtype == "uint16"
    assert man.stats["docs_train"] > 0 and man.stats["docs_val"] > 0
    assert man.tokens("train") > 0 and man.tokens("val") > 0
