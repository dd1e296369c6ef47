"""The trainer machine's dataset cache (storage/dataset.py read_array): a restart
or the next segment reads verified local copies instead of fetching the dataset again."""

from __future__ import annotations

import os

import numpy as np
import pytest

from common.errors import BadData
from storage.dataset import DatasetManifest, commit_manifest, read_split, write_shard
from storage.fs import resolve


def a_dataset(root) -> tuple[str, str, list[str]]:
    """A two-shard train split on `root`: (manifest URI, its directory, the shard files)."""
    fs, directory = resolve(str(root / "dataset"))
    fs.makedirs(directory, exist_ok=True)
    shards = [write_shard(fs, directory, f"train-{i:05d}", "train",
                          np.arange(10 * i, 10 * i + 10, dtype=np.uint16),
                          np.array([0, 4 + i], dtype=np.int64)) for i in range(2)]
    commit_manifest(fs, directory, DatasetManifest(content_hash="h", vocab_size=100, eos_id=99,
                                                   dtype="uint16", shards=tuple(shards)))
    files = [os.path.join(directory, n) for s in shards for n in (s.path, s.docs_path)]
    return os.path.join(directory, "MANIFEST.json"), directory, files


def test_a_second_read_through_the_cache_needs_no_shard_on_the_durable_tier(tmp_path):
    uri, _, files = a_dataset(tmp_path)
    cache = str(tmp_path / "cache")
    tokens, starts = read_split(uri, "train", cache)
    man = DatasetManifest.from_json(open(uri).read())
    assert sorted(os.listdir(cache)) == sorted(
        [s.sha256 for s in man.shards] + [s.docs_sha256 for s in man.shards])
    for f in files:  # the durable copies gone: only the cache can answer now
        os.unlink(f)
    again, again_starts = read_split(uri, "train", cache)
    assert again.tolist() == tokens.tolist() == list(range(20))
    assert again_starts.tolist() == starts.tolist() == [0, 4, 10, 15]
    with pytest.raises(FileNotFoundError):
        read_split(uri, "train")  # without the cache the shards are really gone


def test_a_corrupt_cached_copy_is_dropped_and_fetched_again(tmp_path):
    uri, _, _ = a_dataset(tmp_path)
    cache = tmp_path / "cache"
    read_split(uri, "train", str(cache))
    for name in os.listdir(cache):
        (cache / name).write_bytes(b"rotted")
    tokens, _ = read_split(uri, "train", str(cache))
    assert tokens.tolist() == list(range(20))
    for name in os.listdir(cache):  # the cache holds good copies again
        assert (cache / name).read_bytes() != b"rotted"


def test_a_corrupt_durable_shard_is_refused_and_never_cached(tmp_path):
    uri, _, files = a_dataset(tmp_path)
    with open(files[0], "r+b") as f:
        f.write(b"\xff\xff")
    cache = tmp_path / "cache"
    with pytest.raises(BadData, match="checksum .* does not match manifest"):
        read_split(uri, "train", str(cache))
    assert not cache.exists() or not os.listdir(cache)


def test_a_cache_that_cannot_be_written_costs_only_the_next_fetch(tmp_path):
    uri, _, _ = a_dataset(tmp_path)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    tokens, _ = read_split(uri, "train", str(blocker))
    assert tokens.tolist() == list(range(20))
