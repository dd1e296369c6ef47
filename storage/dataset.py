"""Token shards and the DatasetManifest (the contract between data prep and the trainer).

Layout: `<durable>/datasets/<content_hash>/` holding `tokenizer.json`,
`<split>-<nnnnn>.bin` (raw little-endian token arrays, dtype by vocab size),
`<split>-<nnnnn>.docs.bin` (uint64 start offsets of each document inside the shard),
`<split>-<nnnnn>.index.npz` (where each of those documents came from: storage.provenance),
and `MANIFEST.json`, written last: a dataset exists only once its manifest does.
Documents are separated by the tokenizer's end-of-document token (`eos_id`).

On local disk/NFS every shard and the manifest are written crash-safe (temporary name,
fsync, rename, directory fsync: `storage.fs.pipe_durable`), so a crash never leaves an
empty or torn MANIFEST.json that a later prepare_data would take for a cache hit.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import structlog

from common.errors import BadData
from common.store_json import MAX_RECORD_BYTES, field_int, field_str, load_record
from storage.fs import join, keep_cached, pipe_durable, read_cached, resolve, sha256_stream

log = structlog.get_logger(__name__)

MANIFEST = "MANIFEST.json"
SPLITS = ("train", "val")
# A file a manifest names sits in the dataset's own directory: a plain name, as data prep
# writes them (`tokenizer.json`, `train-00000.bin`). A `/` or `..` in the stored manifest
# would have the readers open files elsewhere in the store, or outside it on a shared file
# system.
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    path: str  # relative to the dataset directory
    split: str  # train | val
    tokens: int
    documents: int
    sha256: str
    docs_path: str  # relative path of the uint64 document-offset array
    docs_sha256: str
    # Relative path of the index of the documents that begin in this shard (their sources,
    # hashes, cleaning figures: storage.provenance); "" in datasets made before it existed.
    index_path: str = ""
    index_sha256: str = ""


@dataclass(frozen=True, kw_only=True)
class DatasetManifest:
    content_hash: str  # hash of (inputs, data config): the cache key
    vocab_size: int
    eos_id: int
    dtype: str
    tokenizer: str = "tokenizer.json"  # relative path
    shards: tuple[ShardInfo, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)  # filter/dedup counts, timings

    def split_shards(self, split: str) -> tuple[ShardInfo, ...]:
        return tuple(s for s in self.shards if s.split == split)

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.split_shards(split))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> DatasetManifest:
        """The manifest as the store holds it: read through the store's JSON reader, every
        field typed and every file it names a plain name in the dataset's directory
        (ValueError naming the field otherwise)."""
        raw = load_record(text, MANIFEST)
        shards = raw.get("shards")
        if not isinstance(shards, list):
            raise ValueError("shards is not a list")
        vocab = field_int(raw, "vocab_size", MANIFEST, low=1, high=1 << 32)
        return cls(content_hash=field_str(raw, "content_hash", MANIFEST, max_len=64),
                   vocab_size=vocab,
                   eos_id=field_int(raw, "eos_id", MANIFEST, high=vocab - 1),
                   dtype=_dtype(raw),
                   tokenizer=_file_name(raw, "tokenizer", MANIFEST, "tokenizer.json"),
                   shards=tuple(_shard(s, f"{MANIFEST}.shards[{i}]")
                                for i, s in enumerate(shards)),
                   stats=raw.get("stats") if isinstance(raw.get("stats"), dict) else {})


def _file_name(raw: dict[str, Any], key: str, what: str, default: str | None = None) -> str:
    """`raw[key]`: a plain file name (`FILE_NAME`); "" only where `default` is "" (an
    optional file). ValueError naming the field otherwise."""
    name = field_str(raw, key, what, max_len=128, default=default)
    if not (name == "" == default) and not FILE_NAME.fullmatch(name):
        raise ValueError(f"{what}.{key} {name[:80]!r} is not a file name in the dataset's "
                         "directory")
    return name


def _dtype(raw: dict[str, Any]) -> str:
    """The token dtype: one `token_dtype` gives (numpy would read any other, an object
    array's included, as whatever it names)."""
    dtype = field_str(raw, "dtype", MANIFEST, max_len=16)
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"{MANIFEST}.dtype {dtype!r} is not uint16 or uint32")
    return dtype


def _shard(raw: Any, what: str) -> ShardInfo:
    """One shard entry, typed; its files plain names (`FILE_NAME`)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{what} is not an object")
    split = field_str(raw, "split", what, max_len=16)
    if split not in SPLITS:
        raise ValueError(f"{what}.split {split!r} is not one of {SPLITS}")
    return ShardInfo(path=_file_name(raw, "path", what), split=split,
                     tokens=field_int(raw, "tokens", what),
                     documents=field_int(raw, "documents", what),
                     sha256=field_str(raw, "sha256", what, max_len=64),
                     docs_path=_file_name(raw, "docs_path", what),
                     docs_sha256=field_str(raw, "docs_sha256", what, max_len=64),
                     index_path=_file_name(raw, "index_path", what, ""),
                     index_sha256=field_str(raw, "index_sha256", what, max_len=64, default=""))


def dataset_dir(durable_url: str, content_hash: str) -> str:
    """URL of a dataset's directory on the durable tier."""
    return join(durable_url.rstrip("/"), "datasets", content_hash)


def manifest_url(durable_url: str, content_hash: str) -> str:
    return join(dataset_dir(durable_url, content_hash), MANIFEST)


def load_manifest(url: str) -> DatasetManifest:
    fs, path = resolve(url)
    try:
        with fs.open(path, "rb") as f:  # one byte past the bound: the reader refuses it
            text = f.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        raise BadData(url, "dataset manifest not found",
                      "run the prepare_data stage first or fix the dataset URL") from None
    try:
        return DatasetManifest.from_json(text)
    except ValueError as exc:  # the store's reader's StoreRecordInvalid is one
        raise BadData(url, f"dataset manifest is unreadable ({type(exc).__name__}: "
                      f"{str(exc)[:100]})", "delete the dataset directory and rerun "
                      "prepare_data") from None


def write_array(fs, path: str, array: np.ndarray) -> str:
    """Write a raw array; return its sha256."""
    data = np.ascontiguousarray(array).tobytes()
    pipe_durable(fs, path, data)
    return sha256_stream(io.BytesIO(data))[0]


def read_array(fs, path: str, dtype: str, expected_sha256: str, url_for_errors: str,
               cache_dir: str | None = None) -> np.ndarray:
    """A raw array, checked against its manifest sha256. With `cache_dir` (a trainer
    machine's fast tier) a verified copy is kept there under its sha256 and read from there
    next time: a restart or the run's next segment on this machine does not fetch the
    dataset from the durable tier again. A cached copy is checked like a fetched
    one; one that does not match is dropped and fetched again."""
    data = _cached(cache_dir, expected_sha256) if cache_dir else None
    if data is None:
        data = fs.cat_file(path)
        digest = sha256_stream(io.BytesIO(data))[0]
        if digest != expected_sha256:
            raise BadData(url_for_errors,
                          f"checksum {digest} does not match manifest {expected_sha256}",
                          "the shard is corrupt: delete the dataset directory and rerun "
                          "prepare_data")
        if cache_dir:
            keep_cached(cache_dir, expected_sha256, data)
    return np.frombuffer(data, dtype=dtype)


def _cached(cache_dir: str, sha256: str) -> bytes | None:
    data = read_cached(cache_dir, sha256)
    if data is None or sha256_stream(io.BytesIO(data))[0] == sha256:
        return data
    log.warning("dataset_cache_mismatch", path=os.path.join(cache_dir, sha256))  # torn, rotted
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(cache_dir, sha256))
    return None


def write_shard(fs, directory: str, name: str, split: str, tokens: np.ndarray,
                doc_starts: np.ndarray, index: bytes | None = None) -> ShardInfo:
    """Write one shard (tokens + document offsets, and the document index `index` when
    given: storage.provenance) under directory; return its manifest entry."""
    path, docs_path = f"{name}.bin", f"{name}.docs.bin"
    sha = write_array(fs, join(directory, path), tokens)
    docs_sha = write_array(fs, join(directory, docs_path), doc_starts.astype(np.uint64))
    index_path = index_sha = ""
    if index is not None:
        index_path = f"{name}.index.npz"
        pipe_durable(fs, join(directory, index_path), index)
        index_sha = sha256_stream(io.BytesIO(index))[0]
    return ShardInfo(path=path, split=split, tokens=int(tokens.size),
                     documents=int(doc_starts.size), sha256=sha, docs_path=docs_path,
                     docs_sha256=docs_sha, index_path=index_path, index_sha256=index_sha)


def commit_manifest(fs, directory: str, manifest: DatasetManifest) -> None:
    """The commit point of a dataset: MANIFEST.json, written after every shard, whole or not
    at all (a retry that rebuilt the same content hash replaces it with the same shards)."""
    pipe_durable(fs, join(directory, MANIFEST), manifest.to_json().encode())


def read_split(manifest_uri: str, split: str, cache_dir: str | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document start offsets) of a whole split, concatenated in shard order.

    Every shard's checksum is verified; a mismatch is BadData naming the shard. With
    `cache_dir`, shards are read through a local cache (read_array).
    """
    man = load_manifest(manifest_uri)
    fs, mpath = resolve(manifest_uri)
    directory = mpath.rsplit("/", 1)[0]
    parts, starts, offset = [], [], 0
    for shard in man.split_shards(split):
        url = fs.unstrip_protocol(join(directory, shard.path))
        parts.append(read_array(fs, join(directory, shard.path), man.dtype, shard.sha256, url,
                                cache_dir))
        docs = read_array(fs, join(directory, shard.docs_path), "uint64", shard.docs_sha256,
                          url, cache_dir)
        starts.append(docs.astype(np.int64) + offset)
        offset += shard.tokens
    if not parts:
        raise BadData(manifest_uri, f"dataset has no {split!r} shards",
                      "use a larger corpus or a different val_fraction")
    return np.concatenate(parts), np.concatenate(starts)


def tokenizer_path(manifest_uri: str) -> str:
    man = load_manifest(manifest_uri)
    return join(manifest_uri.rsplit("/", 1)[0], man.tokenizer)


def document_tokens(manifest_uri: str, split: str, document: int) -> np.ndarray:
    """The tokens of the split's `document`-th document, its end-of-document token left
    out. Reads every shard's document offsets (small) and only the shards the document
    lies in (it may run on into the next). IndexError when the split has fewer documents."""
    man = load_manifest(manifest_uri)
    fs, mpath = resolve(manifest_uri)
    directory = mpath.rsplit("/", 1)[0]
    shards = man.split_shards(split)
    starts, spans, offset = [], [], 0
    for shard in shards:
        url = fs.unstrip_protocol(join(directory, shard.docs_path))
        docs = read_array(fs, join(directory, shard.docs_path), "uint64", shard.docs_sha256, url)
        starts.append(docs.astype(np.int64) + offset)
        spans.append((offset, offset + shard.tokens))
        offset += shard.tokens
    every = np.concatenate(starts) if starts else np.empty(0, np.int64)
    if not 0 <= document < every.size:
        raise IndexError(f"the {split} split has {every.size} documents, not {document + 1}")
    lo = int(every[document])
    hi = int(every[document + 1]) if document + 1 < every.size else offset
    parts = []
    for shard, (a, b) in zip(shards, spans):
        if a < hi and lo < b:
            url = fs.unstrip_protocol(join(directory, shard.path))
            tokens = read_array(fs, join(directory, shard.path), man.dtype, shard.sha256, url)
            parts.append(tokens[max(lo - a, 0):min(hi, b) - a])
    return np.concatenate(parts)[:-1]
