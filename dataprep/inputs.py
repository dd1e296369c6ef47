"""Data prep, stages 1–2: find the corpus files, fingerprint them, read them as documents.

`corpus` is an fsspec URL, local path, directory or glob; `stdlib:<glob>` is a glob under
this Python's standard library sources (the default corpus: text that ships with Python,
so nothing is downloaded). Every failure names the path and the fix (`BadData`), except an
unreachable store, which is retryable (`StorageUnavailable`).

Formats by extension (or `data.format`): text (one document per file), `.jsonl` (one per
record, `data.text_field`), `.parquet` (one per row, column `data.text_field`); any of
them may be compressed as `.gz` or `.zst`. A corrupt archive, an unreadable file or a
missing field/column is BadData naming the file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import sysconfig
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import fsspec
from fsspec.spec import AbstractFileSystem

from common.errors import BadData, StorageUnavailable
from spec import DataConfig
from storage.fs import join, resolve, storage_errors

STDLIB_PREFIX = "stdlib:"
GLOB_CHARS = "*?["
# A directory corpus takes only these; a glob or a single file takes whatever it names.
TEXT_EXTENSIONS = (".txt", ".text", ".md", ".rst", ".py", ".jsonl", ".ndjson", ".parquet")
JSONL_EXTENSIONS = (".jsonl", ".ndjson")
COMPRESSED = (".gz", ".zst")
# Bump when the pipeline's output for the same inputs changes, so old caches are not reused.
# 3: every shard has a document index (storage.provenance) beside its document offsets.
DATAPREP_VERSION = 3
# fsspec `info` keys that change when a file's content does, most specific first
# (S3 ETag / checksum, then local or memory timestamps).
FINGERPRINT_KEYS = ("ETag", "etag", "checksum", "md5", "mtime", "LastModified",
                    "last_modified", "created")
CORPUS_FIX = ("point data.corpus at an existing file, directory, glob or fsspec URL of "
              ".txt/.jsonl/.parquet files (optionally .gz/.zst), or use stdlib:*.py")


@dataclass(frozen=True, kw_only=True)
class InputFile:
    path: str  # path inside `fs`, as fsspec lists it
    url: str  # full URL, for messages and the content hash
    size: int
    fingerprint: str  # size-independent change marker from fsspec `info`


@dataclass(frozen=True, slots=True)
class RawDocument:
    source: str  # file URL, plus `:<line>` for a .jsonl record
    text: str


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def corpus_url(corpus: str) -> str:
    """The fsspec URL or local path the corpus string stands for."""
    if corpus.startswith(STDLIB_PREFIX):
        return join(stdlib_dir(), corpus[len(STDLIB_PREFIX):] or "*.py")
    return corpus


def list_inputs(data: DataConfig) -> tuple[AbstractFileSystem, list[InputFile]]:
    """Sorted input files of the corpus; BadData if there are none or one is unusable."""
    url = corpus_url(data.corpus)
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as exc:  # a typo in the URL is not worth retrying
        raise BadData(data.corpus, f"unknown filesystem protocol {protocol!r} ({exc})",
                      CORPUS_FIX) from None
    fs, root = resolve(url)
    try:
        entries = _list_entries(fs, root)
    except storage_errors() as exc:
        raise StorageUnavailable(url, str(exc)) from exc
    except OSError as exc:
        raise BadData(data.corpus, f"cannot list {url}: {exc}", CORPUS_FIX) from None
    if not entries:
        raise BadData(data.corpus, f"no files match {url}", CORPUS_FIX)
    files = [_input_file(fs, path, info) for path, info in sorted(entries.items())]
    if data.max_documents and all(file_kind(data, f.path) == "txt" for f in files):
        # One document per file: files past the cap are never read, so they are not
        # part of the content hash either (editing them must not invalidate the cache).
        files = files[:data.max_documents]
    return fs, files


def _list_entries(fs: AbstractFileSystem, root: str) -> dict[str, dict[str, Any]]:
    if any(c in root for c in GLOB_CHARS):
        found = fs.glob(root, detail=True)
        return {p: i for p, i in found.items() if i.get("type") != "directory"}
    if fs.isdir(root):
        found = fs.find(root, detail=True)
        return {p: i for p, i in found.items()
                if _plain_name(p).endswith(TEXT_EXTENSIONS) and not _hidden(p[len(root):])}
    if fs.exists(root):
        return {root: fs.info(root)}
    return {}


def _hidden(relative: str) -> bool:
    return any(part.startswith(".") or part == "__pycache__" for part in relative.split("/"))


def _input_file(fs: AbstractFileSystem, path: str, info: dict[str, Any]) -> InputFile:
    url = fs.unstrip_protocol(path)
    if info.get("type") != "file":
        raise BadData(url, f"is not a readable file (type {info.get('type')!r}: a broken "
                      "link or special file)", "remove it or narrow data.corpus to plain files")
    marker = next((info[k] for k in FINGERPRINT_KEYS if info.get(k) is not None), "")
    return InputFile(path=path, url=url, size=int(info.get("size") or 0),
                     fingerprint=str(marker))


def content_hash(data: DataConfig, files: list[InputFile], quarantine: str = "") -> str:
    """Cache key of a dataset: every input's (url, size, change marker) + the data config
    + `quarantine`, the key of the set of quarantined hashes (storage.quarantine
    quarantine_key; "" for none).

    Only listing metadata is used, so a cache hit never reads the corpus. A given
    tokenizer.json is fingerprinted the same way. The quarantine files' URIs are not in
    the key, their hashes are: the same quarantine at another path reuses the dataset, and
    a spec without one keeps the key it had before quarantines existed.
    """
    inputs = sorted((f.url, f.size, f.fingerprint) for f in files)
    tokenizer: list[Any] = []
    if data.tokenizer.path:
        fs, path = resolve(data.tokenizer.path)
        try:
            tokenizer = [asdict(_input_file(fs, path, fs.info(path)))]
        except FileNotFoundError:
            raise BadData(data.tokenizer.path, "tokenizer file not found",
                          "fix data.tokenizer.path or leave it empty to train one") from None
    # `workers` changes how fast, never what: datasets made with any count are the same.
    config = {k: v for k, v in asdict(data).items() if k not in ("workers", "quarantine")}
    key: dict[str, Any] = {"version": DATAPREP_VERSION, "inputs": inputs,
                           "tokenizer": tokenizer, "config": config}
    if quarantine:
        key["quarantine"] = quarantine
    blob = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _plain_name(path: str) -> str:
    """Lower-cased path without a compression suffix."""
    lower = path.lower()
    for ext in COMPRESSED:
        if lower.endswith(ext):
            return lower[:-len(ext)]
    return lower


def file_kind(data: DataConfig, path: str) -> str:
    """txt | jsonl | parquet: how a file becomes documents."""
    if data.format != "auto":
        return data.format
    name = _plain_name(path)
    if name.endswith(JSONL_EXTENSIONS):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "txt"


def read_file_documents(fs: AbstractFileSystem, file: InputFile, data: DataConfig,
                        counts: dict[str, int], limit: int | None = None) -> list[RawDocument]:
    """One file's documents (at most `limit`); counts `undecodable_files`."""
    raw = decompress(file, _read_bytes(fs, file))
    kind = file_kind(data, file.path)
    if kind == "parquet":
        return list(_parquet_documents(file.url, raw, data.text_field, limit))
    text = _decode(raw, counts)
    if kind == "jsonl":
        return list(_jsonl_documents(file.url, text, data.text_field, limit))
    return [RawDocument(file.url, text)]


def _read_bytes(fs: AbstractFileSystem, file: InputFile) -> bytes:
    try:
        return fs.cat_file(file.path)
    except storage_errors() as exc:
        raise StorageUnavailable(file.url, str(exc)) from exc
    except OSError as exc:
        raise BadData(file.url, f"cannot read file: {exc}",
                      "fix its permissions or remove it from data.corpus") from None


def decompress(file: InputFile, raw: bytes) -> bytes:
    """Raw bytes of a .gz/.zst file, or BadData naming it if the archive is corrupt."""
    lower = file.path.lower()
    fix = "re-create or re-download the file, or remove it from data.corpus"
    if lower.endswith(".gz"):
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise BadData(file.url, f"corrupt gzip file ({exc})", fix) from None
    if lower.endswith(".zst"):
        import zstandard

        try:
            with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw),
                                                            read_across_frames=True) as r:
                out = r.read()
        except zstandard.ZstdError as exc:
            raise BadData(file.url, f"corrupt zstd file ({exc})", fix) from None
        if raw and not out:
            raise BadData(file.url, "corrupt zstd file (no complete frame)", fix)
        return out
    return raw


def _decode(raw: bytes, counts: dict[str, int]) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        # Keep the document: U+FFFD marks the bad bytes, and the count says how often.
        counts["undecodable_files"] = counts.get("undecodable_files", 0) + 1
        return raw.decode("utf-8", errors="replace")


def _parquet_documents(url: str, raw: bytes, column: str,
                       limit: int | None) -> Iterator[RawDocument]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(io.BytesIO(raw))
    except (pa.ArrowException, OSError) as exc:
        raise BadData(url, f"not a readable parquet file ({exc})",
                      "re-create the file or remove it from data.corpus") from None
    names = parquet.schema_arrow.names
    if column not in names:
        raise BadData(url, f"has no column {column!r} (its columns: {', '.join(names)})",
                      "set data.text_field to the parquet column holding the text")
    kind = parquet.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise BadData(url, f"column {column!r} has type {kind}, not string",
                      "set data.text_field to a string column")
    taken = 0
    for row, value in enumerate(parquet.read(columns=[column]).column(0).to_pylist()):
        if limit is not None and taken >= limit:
            return
        if value is None:
            continue
        taken += 1
        yield RawDocument(f"{url}:{row}", value)
def _jsonl_documents(url: str, text: str, field: str, limit: int | None) -> Iterator[RawDocument]:
    taken = 0
    for lineno, line in enumerate(text.split("\n"), start=1):
        if limit is not None and taken >= limit:
            return
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadData(f"{url}:{lineno}", f"line {lineno} is not valid JSON ({exc.msg})",
                          "write one JSON object per line") from None
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            keys = sorted(record) if isinstance(record, dict) else []
            problem = (f"line {lineno} has no string field {field!r}"
                       + (f" (its fields: {', '.join(keys)})" if keys else ""))
            raise BadData(url, problem, "set data.text_field to the record's text field")
        taken += 1
        yield RawDocument(f"{url}:{lineno}", value)
