"""The document index: any token position of a split leads back to the input record it
came from, its content hash and the cleaning figures it passed with."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from common.errors import BadData
from dataprep.clean import clean_one
from dataprep.filters import FIGURE_NAMES
from dataprep.inputs import RawDocument
from dataprep.pipeline import prepare_dataset
from spec import DataConfig
from storage.dataset import DatasetManifest, load_manifest, read_split, tokenizer_path
from storage.fs import resolve
from storage.provenance import WHOLE_FILE, DocIndex, load_provenance
from tests.dataprep.test_pipeline import TEXTS, config, write_txt
from tests.dataprep.test_resume import Crash, crash_after

LONG = " ".join(f"long{k} word{k * 3}" for k in range(40))  # 80 words: near dedup bites
NEAR = LONG.replace("word117", "changed")  # one word of 80 changed: Jaccard ~0.95
NOT_NFC = "a document with a combining accent: cafe\u0301 and more words after it"
CONTROL = "a document with a bell \x07 character and a few more words after it"
SPLITS = ("train", "val")


def build_corpus(root: Path) -> Path:
    """jsonl (blank lines, an exact and a near duplicate, a too-short record), parquet
    (a null row), and text files, one of them a duplicate of a jsonl record."""
    corpus = root / "c"
    corpus.mkdir(parents=True)
    lines = [json.dumps({"text": t}) for t in (*TEXTS[:5], LONG, "tiny", TEXTS[2], NOT_NFC)]
    (corpus / "a.jsonl").write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]))
    (corpus / "b.jsonl").write_text("\n".join(json.dumps({"text": t})
                                              for t in (*TEXTS[5:10], NEAR, CONTROL)))
    pq.write_table(pa.table({"text": [TEXTS[10], None, *TEXTS[11:14]]}),
                   str(corpus / "c.parquet"))
    write_txt(corpus / "d", [*TEXTS[14:20], TEXTS[4]])
    return corpus


# (file name, record) of every document that must survive: the first of each duplicate.
KEPT = {("a.jsonl", n) for n in (1, 2, 3, 5, 6, 7, 10)} | {("b.jsonl", n) for n in
                                                          (1, 2, 3, 4, 5, 7)} \
    | {("c.parquet", n) for n in (0, 2, 3, 4)} \
    | {(f"doc{i:03d}.txt", WHOLE_FILE) for i in range(6)}


def data_config(corpus: Path, **kw) -> DataConfig:
    # Small units and shards: several of each, so documents cross shard boundaries.
    return config(corpus, unit_bytes=600, shard_tokens=256, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("provenance")
    data = data_config(build_corpus(root), workers=1)
    url, man, _ = prepare_dataset(data, str(root / "store"), seed=1)
    return {"root": root, "data": data, "url": url, "manifest": man}


def read_record(source: str, record: int) -> str:
    """The raw text of one input record, read the way a person would check it."""
    fs, path = resolve(source)
    if source.endswith(".parquet"):
        return pq.read_table(path).column("text")[record].as_py()
    text = fs.cat_file(path).decode()
    return text if record == WHOLE_FILE else json.loads(text.split("\n")[record - 1])["text"]


@pytest.mark.parametrize("split", SPLITS)
def test_any_token_position_leads_to_the_record_that_cleans_to_its_hash_and_tokens(built,
                                                                                   split):
    url, data = built["url"], built["data"]
    tokens, _ = read_split(url, split)
    prov = load_provenance(url, split)
    fs, path = resolve(tokenizer_path(url))
    tok = Tokenizer.from_str(fs.cat_file(path).decode())
    tok.encode_special_tokens = True
    positions = np.random.default_rng(7).integers(0, tokens.size, 40)
    for pos in [0, tokens.size - 1, *positions.tolist()]:
        doc = prov.at(pos)
        assert doc.start <= pos < doc.start + doc.tokens
        cleaned = clean_one(RawDocument(doc.source, read_record(doc.source, doc.record)),
                            data.cleaning)
        assert cleaned.verdict is None and cleaned.sha256.startswith(doc.sha256)
        ids = tok.encode(cleaned.text, add_special_tokens=False).ids
        assert tokens[doc.start:doc.start + doc.tokens - 1].tolist() == ids
        assert doc.chars == len(cleaned.text)
        assert doc.figures == pytest.approx(cleaned.figures, abs=1e-6)
        assert set(doc.figures) == set(FIGURE_NAMES)  # every quality filter is on here


def test_cleaning_flags_say_what_cleaning_changed(built):
    docs = {}
    for split in SPLITS:
        prov = load_provenance(built["url"], split)
        docs.update({(d.source, d.record): d for d in
                     (prov.index.entry(i) for i in range(len(prov.index)))})
    by_name = {(src.rsplit("/", 1)[1], rec): d for (src, rec), d in docs.items()}
    assert by_name["a.jsonl", 10].normalized and not by_name["a.jsonl", 10].control_stripped
    assert by_name["b.jsonl", 7].control_stripped and not by_name["b.jsonl", 7].normalized
    assert not any(d.normalized or d.control_stripped for k, d in by_name.items()
                   if k not in {("a.jsonl", 10), ("b.jsonl", 7)})


def test_the_index_holds_every_kept_document_once_and_no_dropped_one(built):
    url, man = built["url"], built["manifest"]
    seen = []
    for split in SPLITS:
        prov = load_provenance(url, split)
        _, starts = read_split(url, split)
        assert len(prov.index) == starts.size  # Nth index entry is the Nth document
        seen += [(prov.index.files[f].rsplit("/", 1)[1], int(r))
                 for f, r in zip(prov.index.file, prov.index.record)]
    assert sorted(seen) == sorted(KEPT) and len(seen) == man.stats["docs_out"]
    assert man.stats["exact_dups"] == 2 and man.stats["near_dups"] == 1
    assert all(s.index_path and s.index_sha256 for s in man.shards)
    assert len(man.split_shards("train")) >= 3  # the index really is cut per shard


def test_vectorised_lookup_agrees_with_single_lookups(built):
    prov = load_provenance(built["url"], "train")
    positions = np.arange(0, prov.n_tokens, 7)
    cols = prov.columns(positions)
    for k in range(0, positions.size, 11):
        doc = prov.at(int(positions[k]))
        assert (cols["document"][k], cols["source"][k], cols["record"][k],
                cols["sha256"][k].tobytes().hex()) == (doc.document, doc.source, doc.record,
                                                       doc.sha256)
    with pytest.raises(IndexError):
        prov.documents([prov.n_tokens])


def test_packed_batches_positions_name_the_documents_the_trainer_says_they_hold(built):
    from trainer.data import PackedBatches  # torch: imported only by this test

    tokens, starts = read_split(built["url"], "train")
    prov = load_provenance(built["url"], "train")
    batches = PackedBatches(tokens, starts, seq_len=32, batch_size=4, seed=3)
    for cursor in range(3):
        src = np.stack([row[0] for row in batches.rows(cursor)])
        real = src >= 0
        assert (prov.documents(src[real]) == batches.documents(cursor).numpy()[real]).all()


def test_a_diagnosis_names_an_accused_documents_input_record_and_hash(built):
    from trainer.diagnosis import Sources  # torch: imported only by this test

    prov = load_provenance(built["url"], "train")
    (named,) = Sources(built["url"])([2])
    entry = prov.index.entry(2)
    assert (named["source"], named["record"], named["sha256"]) == \
        (entry.source, entry.record, entry.sha256)
    assert read_record(named["source"], named["record"])  # the record is there to read
    old = copy_dataset(built, "old-sources", lambda i, s: dataclasses.replace(
        s, index_path="", index_sha256=""))
    assert Sources(old)([2]) == []  # a dataset without an index: no sources, no failure


def test_a_resumed_build_writes_the_same_index(built):
    data, store = built["data"], str(built["root"] / "resumed")
    with pytest.raises(Crash):
        prepare_dataset(data, store, seed=1, progress=crash_after("unit_cleaned", 2))
    _, resumed, _ = prepare_dataset(data, store, seed=1)
    assert resumed.stats["resume"]["clean_reused"] == 2  # figures came back from the work dir
    assert index_shas(resumed) == index_shas(built["manifest"])


@pytest.mark.process
def test_worker_processes_write_the_same_index_as_one_process(built):
    data = dataclasses.replace(built["data"], workers=2)
    _, two, _ = prepare_dataset(data, str(built["root"] / "two"), seed=1)
    assert two.stats["workers"] == 2
    assert index_shas(two) == index_shas(built["manifest"])


def index_shas(man: DatasetManifest) -> list[tuple[str, str]]:
    return [(s.index_path, s.index_sha256) for s in man.shards]


def copy_dataset(built, name: str, change) -> str:
    """A copy of the built dataset whose manifest's shards went through `change`."""
    src = Path(resolve(built["url"])[1]).parent
    dst = built["root"] / name / src.name
    shutil.copytree(src, dst)
    man = load_manifest(built["url"])
    man = dataclasses.replace(man, shards=tuple(change(i, s) for i, s in enumerate(man.shards)))
    (dst / "MANIFEST.json").write_text(man.to_json())
    return str(dst / "MANIFEST.json")


def test_a_dataset_without_an_index_loads_and_reads_as_no_provenance(built):
    url = copy_dataset(built, "old", lambda i, s: dataclasses.replace(
        s, index_path="", index_sha256=""))
    raw = json.loads(Path(url).read_text())
    for shard in raw["shards"]:  # written before the index existed: no such keys at all
        del shard["index_path"], shard["index_sha256"]
    Path(url).write_text(json.dumps(raw))
    assert load_provenance(url, "train") is None and load_provenance(url, "val") is None
    tokens, starts = read_split(url, "train")
    assert tokens.size == built["manifest"].tokens("train") and starts.size


def test_an_index_missing_from_one_shard_or_corrupt_is_bad_data(built):
    half = copy_dataset(built, "half", lambda i, s: dataclasses.replace(
        s, index_path="", index_sha256="") if i == 1 else s)
    with pytest.raises(BadData, match="no document index"):
        load_provenance(half, "train")
    rotten = copy_dataset(built, "rotten", lambda i, s: s)
    first = Path(rotten).parent / built["manifest"].shards[0].index_path
    first.write_bytes(first.read_bytes()[:-1] + b"x")
    with pytest.raises(BadData, match="checksum"):
        load_provenance(rotten, "train")


def test_index_bytes_round_trip_and_do_not_depend_on_when_they_were_written(built):
    prov = load_provenance(built["url"], "train")
    blob = prov.index.encode()
    again = DocIndex.decode(blob)
    assert again.encode() == blob and again.files == prov.index.files
    assert (again.figures[~np.isnan(again.figures)]
            == prov.index.figures[~np.isnan(prov.index.figures)]).all()


def test_the_size_benchmark_prints_one_line_whose_figure_is_its_index_bytes_per_doc(capsys):
    import structlog

    from benchmarks.provenance_size import main

    before = structlog.get_config()  # main quiets logging for the whole process
    try:
        assert main(["--docs", "300", "--files", "2", "--shard-tokens", "20000"]) == 0
    finally:
        structlog.configure(**before)
    (line,) = capsys.readouterr().out.strip().splitlines()
    out = json.loads(line)
    assert out["figure"] == "provenance_bytes_per_million_docs" and out["shards"] >= 2
    assert out["value"] == round(out["index_bytes"] / out["docs_out"] * 1e6)
    # Each document costs at least its 16 hash bytes, which do not deflate.
    assert out["column_bytes"]["sha256"] >= 16 * out["docs_out"]
    assert sum(out["column_bytes"].values()) < out["index_bytes"]  # zip headers on top
