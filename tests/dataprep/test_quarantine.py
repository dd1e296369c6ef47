"""Data prep with `data.quarantine`: the documents whose cleaned text a quarantine file
lists are dropped and counted; the dataset's key follows the set of hashes, not where the
files are; an unreadable file fails at once, naming it."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import asdict, replace

import pytest

from common.errors import BadData
from dataprep.inputs import DATAPREP_VERSION, content_hash, list_inputs
from dataprep.pipeline import prepare_dataset
from storage.fs import resolve
from storage.provenance import load_provenance
from tests.dataprep.test_pipeline import TEXTS, all_texts, config, write_txt

PLANTED = ["planted: " + " ".join(f"zebra{i}" for i in range(14)),
           "planted too: " + " ".join(f"quartz{i}" for i in range(14))]


def corpus_with_planted(tmp_path):
    """Twelve ordinary documents and two planted ones, the first planted one in two files."""
    return write_txt(tmp_path / "c", TEXTS[:12] + PLANTED + PLANTED[:1])


def indexed_hashes(url: str, texts: list[str]) -> list[str]:
    """The document index's hashes (either split) of the documents with these texts."""
    wanted = {hashlib.sha256(t.encode()).hexdigest()[:32] for t in texts}
    found = []
    for split in ("train", "val"):
        index = load_provenance(url, split).index
        found += [index.entry(d).sha256 for d in range(len(index))]
    return sorted({h for h in found if h in wanted})


def write_quarantine_file(path, hashes: list[str]) -> str:
    fs, p = resolve(str(path))
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(p, "".join(json.dumps({"sha256": h, "run_id": "old"}) + "\n"
                            for h in hashes).encode())
    return str(path)


def test_a_quarantine_drops_exactly_its_documents_every_copy_and_counts_them(tmp_path):
    corpus, store = corpus_with_planted(tmp_path), str(tmp_path / "store")
    url, base, _ = prepare_dataset(config(corpus), store, seed=1)
    assert base.stats["dropped_quarantined"] == 0 and base.stats["exact_dups"] == 1
    hashes = indexed_hashes(url, PLANTED)
    assert len(hashes) == 2  # the same hash the index wrote: the trainer's accusation's
    q = write_quarantine_file(tmp_path / "runs" / "old" / "quarantine.jsonl", hashes)
    url2, man, hit = prepare_dataset(config(corpus, quarantine=(q,)), store, seed=1)
    assert not hit and url2 != url and man.content_hash != base.content_hash
    assert sorted(all_texts(url2)) == sorted(t for t in all_texts(url) if t not in PLANTED)
    assert man.stats["dropped_quarantined"] == 3  # both planted texts, and the copy
    assert man.stats["quarantine_hashes"] == 2
    assert man.stats["exact_dups"] == 0  # the copy went as quarantined, not as a duplicate
    assert man.stats["docs_out"] == base.stats["docs_out"] - 2


@pytest.fixture(params=["file", "s3"])
def elsewhere(request, tmp_path) -> str:
    """Another place for a quarantine file: a local directory, or real SeaweedFS S3."""
    if request.param == "file":
        return str(tmp_path / "copied" / "q.jsonl")
    request.getfixturevalue("s3_env")
    return f"s3://mainspring/tests/{uuid.uuid4().hex[:12]}/quarantine.jsonl"


def test_the_same_hashes_anywhere_in_any_order_reuse_the_dataset(tmp_path, elsewhere):
    corpus, store = corpus_with_planted(tmp_path), str(tmp_path / "store")
    url, _, _ = prepare_dataset(config(corpus), store, seed=1)
    hashes = indexed_hashes(url, PLANTED)
    first = write_quarantine_file(tmp_path / "q1.jsonl", hashes)
    url1, man1, _ = prepare_dataset(config(corpus, quarantine=(first,)), store, seed=1)
    moved = write_quarantine_file(elsewhere, hashes[::-1] + hashes[:1])
    url2, man2, hit = prepare_dataset(config(corpus, quarantine=(moved,)), store, seed=1)
    assert hit and (url2, man2.content_hash) == (url1, man1.content_hash)


def test_no_quarantine_or_an_empty_one_keeps_the_key_datasets_had_before_quarantines(tmp_path):
    corpus = corpus_with_planted(tmp_path)
    data = config(corpus)
    _, files = list_inputs(data)
    # the key's recipe before `data.quarantine` existed: a dataset made then keeps its key
    old = {k: v for k, v in asdict(data).items() if k not in ("workers", "quarantine")}
    blob = json.dumps({"version": DATAPREP_VERSION, "inputs": sorted(
        (f.url, f.size, f.fingerprint) for f in files), "tokenizer": [], "config": old},
        sort_keys=True, default=str)
    assert content_hash(data, files) == hashlib.sha256(blob.encode()).hexdigest()[:16]
    store = str(tmp_path / "store")
    url, man, _ = prepare_dataset(data, store, seed=1)
    assert man.content_hash == content_hash(data, files)
    empty = write_quarantine_file(tmp_path / "empty.jsonl", [])
    url2, _, hit = prepare_dataset(replace(data, quarantine=(empty,)), store, seed=1)
    assert hit and url2 == url


def test_an_unreadable_quarantine_file_fails_data_prep_at_once_naming_it(tmp_path):
    corpus, store = corpus_with_planted(tmp_path), tmp_path / "store"
    missing = str(tmp_path / "runs" / "gone" / "quarantine.jsonl")
    with pytest.raises(BadData) as err:
        prepare_dataset(config(corpus, quarantine=(missing,)), str(store), seed=1)
    assert err.value.path == missing and not err.value.retryable
    assert "data.quarantine" in err.value.fix
    assert not store.exists() or not any(store.rglob("MANIFEST.json"))  # nothing was built


def test_a_document_read_alone_is_its_slice_of_the_split_across_shard_cuts(tmp_path):
    from storage.dataset import document_tokens, load_manifest, read_split

    corpus = write_txt(tmp_path / "c", TEXTS[:10])
    url, man, _ = prepare_dataset(config(corpus, shard_tokens=16), str(tmp_path / "s"), seed=1)
    assert len(man.split_shards("train")) > 3  # documents run on into the next shard
    tokens, starts = read_split(url, "train")
    ends = [*starts[1:].tolist(), tokens.size]
    for d, (a, b) in enumerate(zip(starts.tolist(), ends)):
        assert document_tokens(url, "train", d).tolist() == tokens[a:b - 1].tolist()
    assert load_manifest(url).eos_id not in document_tokens(url, "train", 0)
    with pytest.raises(IndexError):
        document_tokens(url, "train", len(starts))
