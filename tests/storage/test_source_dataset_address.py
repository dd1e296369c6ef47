"""Store data is data, never an address: the dataset of an init_from source or a teacher is
found by the content hash its `dataset_ready` event names, under this store's
`datasets/<hash>/` — whatever `uri` the event holds is never opened (storage/init_source.py),
and a dataset manifest names files of its own directory only (storage/dataset.py)."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from common.errors import BadData
from spec import RunSpec
from storage.dataset import load_manifest
from storage.init_source import check_fit
from storage.teacher_source import check_teacher
from tests.storage.source_runs import MODEL, SOURCE_HASH, dataset, source_store


def child(url: str) -> RunSpec:
    return RunSpec.from_dict({"run_id": "child", "model": MODEL, "storage": {"durable": url},
                              "train": {"micro_batch_tokens": 128, "init_from": "base"}})


def student(url: str) -> RunSpec:
    return RunSpec.from_dict({"run_id": "student", "model": {**MODEL, "d_model": 16},
                              "train": {"micro_batch_tokens": 128},
                              "distill": {"teacher": "base"}, "storage": {"durable": url}})


@pytest.fixture
def listener():
    """A local HTTP endpoint (an 'internal address') that counts the requests it gets."""
    hits: list[str] = []

    class Count(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 — http.server's name
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Count)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/MANIFEST.json", hits
    server.shutdown()


def test_an_events_internal_http_uri_is_never_fetched_the_stores_dataset_is_read(
        tmp_path, listener):
    address, hits = listener
    store = source_store(tmp_path, {"uri": address, "content_hash": SOURCE_HASH})
    ours = dataset(tmp_path / "ours", "tokenizer A")
    source = check_fit(child(store), ours, load_manifest(ours))
    assert (source.run_id, source.step) == ("base", 8)
    assert check_teacher(student(store), ours, load_manifest(ours)).run_id == "base"
    assert hits == []


def test_an_events_foreign_file_uri_is_ignored_in_favour_of_the_dataset_its_hash_names(
        tmp_path):
    # a manifest outside the store with another tokenizer: read, it would refuse the child
    foreign = dataset(tmp_path / "elsewhere", "tokenizer B")
    store = source_store(tmp_path, {"uri": foreign, "content_hash": SOURCE_HASH})
    ours = dataset(tmp_path / "ours", "tokenizer A")
    assert check_fit(child(store), ours, load_manifest(ours)).run_id == "base"


@pytest.mark.parametrize("payload", [
    {},  # neither uri nor content_hash: a KeyError once, retried for hours
    {"uri": "file:///dev/zero"},
    {"uri": "file:///dev/zero", "content_hash": "../../runs/other/x"},
    {"content_hash": 5},
    {"content_hash": "0123456789ABCDEF/.."},
], ids=["empty", "uri-only", "traversal", "number", "not-hex"])
def test_a_malformed_dataset_ready_event_is_bad_data_naming_the_run_and_field(tmp_path,
                                                                              payload):
    store = source_store(tmp_path, payload)
    ours = dataset(tmp_path / "ours", "tokenizer A")
    for spec, field, check in ((child(store), "train.init_from", check_fit),
                               (student(store), "distill.teacher", check_teacher)):
        with pytest.raises(BadData) as err:
            check(spec, ours, load_manifest(ours))
        assert not err.value.retryable
        assert "run base" in err.value.problem and field in err.value.problem
        assert "content_hash" in err.value.problem and "dataset_ready" in err.value.problem


def test_a_source_dataset_gone_from_the_store_is_bad_data_naming_the_source_run(tmp_path):
    store = source_store(tmp_path, {"content_hash": "fedcba9876543210"})
    ours = dataset(tmp_path / "ours", "tokenizer A")
    with pytest.raises(BadData) as err:
        check_fit(child(store), ours, load_manifest(ours))
    assert err.value.path.endswith("datasets/fedcba9876543210/MANIFEST.json")
    assert "run base" in err.value.problem and "train.init_from" in err.value.problem


@pytest.mark.parametrize("field, value", [
    ("tokenizer", "../../../secret/tokenizer.json"),
    ("tokenizer", "sub/tokenizer.json"),
    ("shard path", "../../other/train-00000.bin"),
    ("shard docs_path", "/etc/hostname"),
    ("dtype", "object"),
])
def test_a_dataset_manifest_naming_a_file_outside_its_directory_is_bad_data(tmp_path, field,
                                                                          value):
    uri = dataset(tmp_path / "d", "tokenizer A")
    path = tmp_path / "d" / "MANIFEST.json"
    raw = json.loads(path.read_text())
    raw["shards"] = [{"path": "train-00000.bin", "split": "train", "tokens": 4, "documents": 1,
                      "sha256": "0" * 64, "docs_path": "train-00000.docs.bin",
                      "docs_sha256": "0" * 64}]
    if field.startswith("shard "):
        raw["shards"][0][field.split()[1]] = value
    else:
        raw[field] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(BadData) as err:
        load_manifest(uri)
    assert field.split()[-1] in err.value.problem and "unreadable" in err.value.problem


def test_a_dataset_manifest_nested_deep_or_with_infinity_is_bad_data_not_a_crash(tmp_path):
    uri = dataset(tmp_path / "d", "tokenizer A")
    path = tmp_path / "d" / "MANIFEST.json"
    for text in ('{"stats": ' + "[" * 100_000 + "]" * 100_000 + "}",
                 path.read_text().replace('"vocab_size": 512', '"vocab_size": Infinity')):
        path.write_text(text)
        with pytest.raises(BadData):
            load_manifest(uri)
