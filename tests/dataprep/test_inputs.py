"""Corpus formats (parquet, gz, zst), S3 corpora, and bad input named as BadData."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from common.errors import BadData
from dataprep.pipeline import prepare_dataset
from storage.fs import resolve
from tests.dataprep.test_pipeline import TEXTS, all_texts, config, write_txt


def write_parquet(path, columns: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), str(path))


def test_parquet_column_gives_one_document_per_row(tmp_path):
    write_parquet(tmp_path / "c" / "a.parquet", {"id": list(range(5)), "body": TEXTS[:5]})
    write_parquet(tmp_path / "c" / "b.parquet", {"body": TEXTS[5:9] + [None]})  # null skipped
    url, man, _ = prepare_dataset(config(tmp_path / "c", text_field="body"),
                                  str(tmp_path / "store"), seed=1)
    assert (man.stats["files"], man.stats["docs_in"]) == (2, 9)
    assert sorted(all_texts(url)) == sorted(TEXTS[:9])


def test_parquet_without_the_column_is_bad_data_listing_its_columns(tmp_path):
    write_parquet(tmp_path / "c" / "a.parquet", {"id": [1, 2], "content": TEXTS[:2]})
    with pytest.raises(BadData) as err:
        prepare_dataset(config(tmp_path / "c"), str(tmp_path / "store"), seed=1)
    assert err.value.path.endswith("a.parquet")
    assert "no column 'text'" in err.value.problem and "content" in err.value.problem
    assert "data.text_field" in err.value.fix and not err.value.retryable


def test_parquet_column_that_is_not_text_is_bad_data(tmp_path):
    write_parquet(tmp_path / "c" / "a.parquet", {"text": [1, 2, 3]})
    with pytest.raises(BadData) as err:
        prepare_dataset(config(tmp_path / "c"), str(tmp_path / "store"), seed=1)
    assert "not string" in err.value.problem


def test_corrupt_parquet_is_bad_data_naming_the_file(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(BadData) as err:
        prepare_dataset(config(tmp_path / "c"), str(tmp_path / "store"), seed=1)
    assert err.value.path.endswith("broken.parquet") and "parquet" in err.value.problem


def test_gzip_and_zstd_files_are_decompressed_by_extension(tmp_path):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt.gz").write_bytes(gzip.compress(TEXTS[0].encode()))
    (corpus / "b.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(TEXTS[1].encode()))
    lines = "\n".join(json.dumps({"text": t}) for t in TEXTS[2:6])
    (corpus / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    (corpus / "d.jsonl.gz").write_bytes(gzip.compress(json.dumps({"text": TEXTS[6]}).encode()))
    url, man, _ = prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1)
    assert (man.stats["files"], man.stats["docs_in"]) == (4, 7)
    assert sorted(all_texts(url)) == sorted(TEXTS[:7])


@pytest.mark.parametrize("name, blob", [
    ("bad.txt.gz", gzip.compress(TEXTS[0].encode())[:-12]),  # truncated
    ("bad.txt.gz", b"not gzip at all"),
    ("bad.txt.zst", zstandard.ZstdCompressor().compress(TEXTS[0].encode() * 20)[:-9]),
    ("bad.txt.zst", b"not zstd at all"),
])
def test_corrupt_compressed_file_is_bad_data_naming_it(tmp_path, name, blob):
    corpus = write_txt(tmp_path / "c", TEXTS[:3])
    (corpus / name).write_bytes(blob)
    with pytest.raises(BadData) as err:
        prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1)
    assert err.value.path.endswith(name) and "corrupt" in err.value.problem
    assert not err.value.retryable


def test_unreadable_file_is_bad_data_naming_it(tmp_path):
    corpus = write_txt(tmp_path / "c", TEXTS[:3])
    (corpus / "doc001.txt").chmod(0)
    try:
        with open(corpus / "doc001.txt", "rb"):
            pytest.skip("running as a user that ignores file permissions")
    except PermissionError:
        pass
    with pytest.raises(BadData) as err:
        prepare_dataset(config(corpus), str(tmp_path / "store"), seed=1)
    assert err.value.path.endswith("doc001.txt") and "cannot read" in err.value.problem


def test_s3_corpus_by_glob_prepares_the_same_dataset_as_local_files(tmp_path, s3_env, seaweed):
    local = write_txt(tmp_path / "c", TEXTS[:8])
    fs, root = resolve(f"s3://{seaweed.bucket}/dataprep-corpus")
    for path in sorted(local.iterdir()):
        fs.pipe_file(f"{root}/{path.name}", path.read_bytes())
    s3_url, s3_man, _ = prepare_dataset(config(f"s3://{seaweed.bucket}/dataprep-corpus/*.txt"),
                                        str(tmp_path / "store"), seed=1)
    _, local_man, _ = prepare_dataset(config(local), str(tmp_path / "store"), seed=1)
    assert s3_man.stats["files"] == 8 and sorted(all_texts(s3_url)) == sorted(TEXTS[:8])
    assert [s.sha256 for s in s3_man.shards] == [s.sha256 for s in local_man.shards]
