"""The document index: where every document of a split came from, for any token position.

Data prep writes, beside each shard's document offsets, `<split>-<nnnnn>.index.npz`: one
entry per document that *begins* in the shard, in token-stream order, so the shards'
indexes concatenated in manifest order are the split's index and its Nth entry is the
Nth document of the split's token stream (the Nth of `read_split`'s doc_starts). The
manifest lists each file with its sha256, like the shard itself.

The file is an npz of columns (one row per document), not one record per document:
- `files`: the distinct input file URLs of the shard (a small string table: the UTF-8
  bytes of a JSON list, as is `figure_names`);
- `file` (uint32): each document's entry in `files`;
- `record` (int64): its record in that file: jsonl line (1-based), parquet row (0-based),
  -1 when the whole file is the document (text formats);
- `sha256` (uint8, HASH_BYTES per document): the start of the sha256 of its cleaned text,
  the identity dedup and the split use;
- `chars` (uint32): length of the cleaned text in characters;
- `flags` (uint8): NORMALIZED | CONTROL_STRIPPED, what cleaning changed;
- `figures` (float32, one column per `figure_names` entry): the quality measures it passed
  with; NaN where that filter was off.
Members are deflated and stamped with a fixed time, so equal indexes are equal bytes and a
resumed or multi-process build gives the same sha256 as a single uninterrupted one.

A dataset made before the index existed has none (`ShardInfo.index_path` empty):
`load_provenance` returns None, "no provenance", and the trainer goes on without it.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import structlog

from common.errors import BadData
from common.store_json import StoreRecordInvalid, load_record
from storage.dataset import load_manifest, read_array
from storage.fs import join, resolve

log = structlog.get_logger(__name__)

HASH_BYTES = 16  # 128 bits of sha256: no collision in any corpus we could tokenize
NORMALIZED, CONTROL_STRIPPED = 1, 2
WHOLE_FILE = -1
_STAMP = (1980, 1, 1, 0, 0, 0)  # the zip epoch: a fixed time keeps the bytes reproducible
INDEX_FIX = "the dataset is corrupt or half-made: delete its directory and rerun prepare_data"


@dataclass(frozen=True, kw_only=True)
class DocumentRecord:
    """One document of a split, as the index describes it."""

    document: int  # its number in the split: the Nth document of the token stream
    start: int  # its first token's position in the split
    tokens: int  # its length in tokens, end-of-document token included
    source: str  # input file URL
    record: int  # jsonl line (1-based), parquet row (0-based), -1: the whole file
    sha256: str  # hex start (HASH_BYTES bytes) of the sha256 of its cleaned text
    chars: int  # cleaned length in characters
    normalized: bool  # Unicode normalisation changed it
    control_stripped: bool  # control characters were removed
    figures: dict[str, float]  # the quality figures it passed with (filters that were on)


@dataclass(frozen=True, eq=False)
class DocIndex:
    """Columns of a document index (see the module doc); row i describes document i."""

    files: tuple[str, ...]
    file: np.ndarray
    record: np.ndarray
    sha256: np.ndarray
    chars: np.ndarray
    flags: np.ndarray
    figure_names: tuple[str, ...]
    figures: np.ndarray

    def __len__(self) -> int:
        return int(self.file.size)

    @classmethod
    def build(cls, files: Sequence[str], file: Sequence[int], record: Sequence[int],
              sha256_hex: Sequence[str], chars: Sequence[int], flags: Sequence[int],
              figure_names: Sequence[str], figures: np.ndarray) -> DocIndex:
        digest = np.frombuffer(b"".join(bytes.fromhex(h[:2 * HASH_BYTES]) for h in sha256_hex),
                               dtype=np.uint8).reshape(len(sha256_hex), HASH_BYTES)
        return cls(files=tuple(files), file=np.asarray(file, np.uint32),
                   record=np.asarray(record, np.int64), sha256=digest,
                   chars=np.asarray(chars, np.uint32), flags=np.asarray(flags, np.uint8),
                   figure_names=tuple(figure_names),
                   figures=np.asarray(figures, np.float32).reshape(len(sha256_hex),
                                                                   len(figure_names)))

    def take(self, lo: int, hi: int) -> DocIndex:
        """Rows [lo, hi), with a string table of only the files they use."""
        used, file = np.unique(self.file[lo:hi], return_inverse=True)
        return DocIndex(files=tuple(self.files[i] for i in used), file=file.astype(np.uint32),
                        record=self.record[lo:hi], sha256=self.sha256[lo:hi],
                        chars=self.chars[lo:hi], flags=self.flags[lo:hi],
                        figure_names=self.figure_names, figures=self.figures[lo:hi])

    @classmethod
    def concat(cls, parts: Sequence[DocIndex]) -> DocIndex:
        """The (one or more) parts one after the other, their string tables merged."""
        names = parts[0].figure_names
        if any(p.figure_names != names for p in parts):
            raise ValueError("document indexes with different figure columns")
        table: dict[str, int] = {}
        file = []
        for part in parts:
            ids = np.array([table.setdefault(f, len(table)) for f in part.files], np.uint32)
            file.append(ids[part.file] if part.files else part.file)

        def cat(column: str) -> np.ndarray:
            return np.concatenate([getattr(p, column) for p in parts])
        return cls(files=tuple(table), file=np.concatenate(file), record=cat("record"),
                   sha256=cat("sha256"), chars=cat("chars"), flags=cat("flags"),
                   figure_names=names, figures=cat("figures"))

    def encode(self) -> bytes:
        """Deterministic npz bytes: equal indexes give equal bytes (and sha256)."""
        columns = {"files": _strings(self.files), "file": self.file, "record": self.record,
                   "sha256": self.sha256, "chars": self.chars, "flags": self.flags,
                   "figure_names": _strings(self.figure_names), "figures": self.figures}
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for name in sorted(columns):
                member = io.BytesIO()
                np.lib.format.write_array(member, np.ascontiguousarray(columns[name]),
                                          allow_pickle=False)
                info = zipfile.ZipInfo(f"{name}.npy", date_time=_STAMP)
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, member.getvalue())
        return buf.getvalue()

    @classmethod
    def decode(cls, blob: bytes, url_for_errors: str = "document index") -> DocIndex:
        try:
            with np.load(io.BytesIO(blob), allow_pickle=False) as z:
                c: Mapping[str, np.ndarray] = {k: z[k] for k in z.files}
            return cls(files=_unstrings(c["files"]), file=c["file"], record=c["record"],
                       sha256=c["sha256"], chars=c["chars"], flags=c["flags"],
                       figure_names=_unstrings(c["figure_names"]), figures=c["figures"])
        except (ValueError, KeyError, OSError, zipfile.BadZipFile) as exc:
            raise BadData(url_for_errors, f"unreadable document index ({exc})",
                          INDEX_FIX) from None

    def entry(self, document: int, start: int = -1, tokens: int = 0) -> DocumentRecord:
        flags = int(self.flags[document])
        return DocumentRecord(
            document=int(document), start=int(start), tokens=int(tokens),
            source=self.files[int(self.file[document])], record=int(self.record[document]),
            sha256=self.sha256[document].tobytes().hex(), chars=int(self.chars[document]),
            normalized=bool(flags & NORMALIZED), control_stripped=bool(flags & CONTROL_STRIPPED),
            figures={n: float(v) for n, v in zip(self.figure_names, self.figures[document])
                     if not np.isnan(v)})


def _strings(strings: Sequence[str]) -> np.ndarray:
    """A string table as the UTF-8 bytes of its JSON list: numpy's own string arrays are
    UTF-32 padded to the longest entry, 4x or more the size."""
    return np.frombuffer(json.dumps(list(strings)).encode(), dtype=np.uint8)


def _unstrings(column: np.ndarray) -> tuple[str, ...]:
    strings = load_record(column.tobytes(), "string table", expect=list)
    if not all(isinstance(s, str) for s in strings):
        raise StoreRecordInvalid("string table", "holds something other than strings")
    return tuple(strings)


@dataclass(frozen=True, eq=False)
class Provenance:
    """A split's document index with its document offsets: token position → document."""

    index: DocIndex
    doc_starts: np.ndarray  # int64: each document's first position in the split
    n_tokens: int

    def documents(self, positions: np.ndarray | Sequence[int]) -> np.ndarray:
        """The document number (in the split) holding each token position; vectorised.
        The positions are those of `read_split`'s token array, as trainer.data uses them."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n_tokens):
            raise IndexError(f"token positions must be in [0, {self.n_tokens})")
        # side="right": an empty document repeats the next one's start; this picks the latter.
        return np.searchsorted(self.doc_starts, pos, side="right") - 1

    def columns(self, positions: np.ndarray | Sequence[int]) -> dict[str, np.ndarray]:
        """Every index column at each token position (shape of `positions`), plus
        `document`; `source` holds the file URLs (an object array)."""
        doc = self.documents(positions)
        files = np.array(self.index.files, dtype=object)
        return {"document": doc, "source": files[self.index.file[doc]],
                "record": self.index.record[doc], "sha256": self.index.sha256[doc],
                "chars": self.index.chars[doc], "flags": self.index.flags[doc],
                "figures": self.index.figures[doc]}

    def at(self, position: int) -> DocumentRecord:
        """The document holding token `position` of the split."""
        doc = int(self.documents([position])[0])
        end = self.doc_starts[doc + 1] if doc + 1 < self.doc_starts.size else self.n_tokens
        start = int(self.doc_starts[doc])
        return self.index.entry(doc, start, int(end) - start)


def load_provenance(manifest_uri: str, split: str,
                    cache_dir: str | None = None) -> Provenance | None:
    """The split's provenance, checked against the manifest's checksums; None when the
    dataset predates the document index (logged: its spikes cannot name their sources).
    BadData when only some shards have an index or one does not match its offsets."""
    man = load_manifest(manifest_uri)
    shards = man.split_shards(split)
    if not shards or not any(s.index_path for s in shards):
        log.info("dataset_without_provenance", manifest=manifest_uri, split=split)
        return None
    fs, mpath = resolve(manifest_uri)
    directory = mpath.rsplit("/", 1)[0]
    parts, starts, offset = [], [], 0
    for shard in shards:
        url = fs.unstrip_protocol(join(directory, shard.index_path or shard.docs_path))
        if not shard.index_path:
            raise BadData(url, f"shard {shard.path} has no document index while others do",
                          INDEX_FIX)
        blob = read_array(fs, join(directory, shard.index_path), "uint8", shard.index_sha256,
                          url, cache_dir).tobytes()
        part = DocIndex.decode(blob, url)
        docs = read_array(fs, join(directory, shard.docs_path), "uint64", shard.docs_sha256,
                          url, cache_dir)
        if len(part) != docs.size:
            raise BadData(url, f"indexes {len(part)} documents, the shard begins {docs.size}",
                          INDEX_FIX)
        parts.append(part)
        starts.append(docs.astype(np.int64) + offset)
        offset += shard.tokens
    return Provenance(DocIndex.concat(parts), np.concatenate(starts), offset)
