"""A run's quarantine: the documents its loss spikes were diagnosed as caused by.

When a rollback's replay finds the data guilty (trainer/diagnosis.py), the trainer records
a `spike_diagnosed` event with `verdict: "data"`, the guilty documents' numbers, their
records (`sources`: input file, record, the sha256 prefix of the cleaned text, chars) and
the evidence (`outliers`: each document's loss and robust z). The quarantine is derived
from those durable events alone, so it can be written again at any time with the same
bytes: `runs/<run_id>/quarantine.jsonl`, one JSON line per document, deduplicated by
content hash (the first diagnosis that named a text keeps it), replaced whole (atomic on
disk, one PUT on S3).

A later data prep reads such files (`data.quarantine`) and drops every document whose
cleaned text has one of their hashes (dataprep/pipeline.py); the dataset's cache key
covers the set of hashes, not where the files are (`quarantine_key`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import structlog

from common.errors import BadData, StorageUnavailable
from common.store_json import load_line
from storage.events import read_events
from storage.fs import is_unavailable, join, pipe_durable, resolve, storage_errors
from storage.provenance import HASH_BYTES

log = structlog.get_logger(__name__)

QUARANTINE = "quarantine.jsonl"
DIAGNOSED = "spike_diagnosed"
HASH_HEX = 2 * HASH_BYTES  # the document index's hash prefix, in hex digits
_HEX = re.compile(r"[0-9a-f]+")
READ_FIX = ("make the file readable by the data worker, fix the URI in data.quarantine, or "
            "remove it from the list")


@dataclass(frozen=True, kw_only=True)
class QuarantineEntry:
    """One quarantined document: what it is, where it came from, why it is accused."""

    run_id: str  # the run whose diagnosis accused it
    source: str  # input file URL (redacted as the document index stores it)
    record: int  # jsonl line (1-based), parquet row (0-based), -1: the whole file
    sha256: str  # hex start (HASH_HEX digits) of the sha256 of its cleaned text
    chars: int  # cleaned length in characters
    document: int  # its number in that run's train split
    step: int | None  # the step whose spike was diagnosed
    z: float | None  # its robust z against the window's other documents
    loss: float | None  # its mean loss on the healthy weights
    verdict: str  # the diagnosis' verdict ("data")
    event_id: str  # the `spike_diagnosed` event it came from

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> QuarantineEntry:
        """A line of a quarantine file; only `sha256` is required (a hand-written file may
        hold nothing else), the rest default to unknown."""
        return cls(run_id=str(d.get("run_id", "")), source=str(d.get("source", "")),
                   record=_int(d.get("record"), -1), sha256=str(d["sha256"]),
                   chars=_int(d.get("chars"), 0), document=_int(d.get("document"), -1),
                   step=_int(d.get("step"), None), z=_float(d.get("z")),
                   loss=_float(d.get("loss")), verdict=str(d.get("verdict", "")),
                   event_id=str(d.get("event_id", "")))


def quarantine_entries(events: Iterable[Mapping[str, Any]]) -> list[QuarantineEntry]:
    """Pure: the quarantine of a run's events (in log order): each document a `data`
    diagnosis named with a content hash, once per hash (the earliest event keeps it).
    Other verdicts, other kinds and accusations without a record (a dataset made before
    the document index) contribute nothing: there is no hash to drop them by."""
    out: dict[str, QuarantineEntry] = {}
    for event in events:
        payload = event.get("payload") or {}
        if event.get("kind") != DIAGNOSED or payload.get("verdict") != "data":
            continue
        outliers = {o.get("document"): o for o in payload.get("outliers") or []
                    if isinstance(o, Mapping)}
        for src in payload.get("sources") or []:
            sha = normalized_hash(src.get("sha256")) if isinstance(src, Mapping) else None
            if sha is None or sha in out:
                continue
            evidence = outliers.get(src.get("document"), {})
            out[sha] = QuarantineEntry(
                run_id=str(event.get("run_id", "")), source=str(src.get("source", "")),
                record=_int(src.get("record"), -1), sha256=sha, chars=_int(src.get("chars"), 0),
                document=_int(src.get("document"), -1), step=_int(event.get("step"), None),
                z=_float(evidence.get("z")), loss=_float(evidence.get("loss")),
                verdict="data", event_id=str(event.get("event_id", "")))
    return list(out.values())


def normalized_hash(value: object) -> str | None:
    """Pure: the HASH_HEX-digit lower-case prefix of a hex sha256 (a full digest is cut to
    the index's length); None when `value` is not one."""
    if not isinstance(value, str):
        return None
    h = value.strip().lower()
    return h[:HASH_HEX] if len(h) >= HASH_HEX and _HEX.fullmatch(h) else None


def quarantine_key(hashes: Iterable[str]) -> str:
    """Pure: a digest of the sorted set of hashes: equal quarantines, wherever their files
    are and however their lines are ordered, give one key (a dataset's cache key)."""
    blob = "\n".join(sorted(set(hashes)))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def encode(entries: Iterable[QuarantineEntry]) -> bytes:
    """Pure: the file's bytes, one sorted-key JSON object per line."""
    return "".join(json.dumps(e.to_json(), sort_keys=True, allow_nan=False) + "\n"
                   for e in entries).encode()


def quarantine_uri(durable_url: str, run_id: str) -> str:
    """Where the run's quarantine file is, as a URL data.quarantine takes."""
    fs, root = resolve(durable_url)
    return fs.unstrip_protocol(join(root, "runs", run_id, QUARANTINE))


def write_quarantine(durable_url: str, run_id: str,
                     cache_dir: str | None = None) -> tuple[str, int]:
    """(URI, entries): derive the run's quarantine from its event log and replace the file
    with it. Idempotent (the same events give the same bytes); a storage outage is
    StorageUnavailable (retryable)."""
    entries = quarantine_entries(read_events(durable_url, run_id, (DIAGNOSED,), cache_dir))
    fs, root = resolve(durable_url)
    path = join(root, "runs", run_id, QUARANTINE)
    try:
        fs.makedirs(join(root, "runs", run_id), exist_ok=True)
        pipe_durable(fs, path, encode(entries))
    except Exception as exc:
        if is_unavailable(exc):
            raise StorageUnavailable(durable_url, repr(exc)) from exc
        raise
    uri = fs.unstrip_protocol(path)
    log.info("quarantine_written", run_id=run_id, uri=uri, documents=len(entries))
    return uri, len(entries)


def read_quarantine(uri: str) -> list[QuarantineEntry]:
    """The entries of one quarantine file. BadData naming `uri` (not retryable: reading it
    again would fail the same way) when it is missing, unreadable or has a line without a
    hash; StorageUnavailable when its store is down."""
    try:
        fs, path = resolve(uri)
        raw = fs.cat_file(path)
    except storage_errors() as exc:
        raise StorageUnavailable(uri, str(exc)) from exc
    except (OSError, ValueError) as exc:  # missing, a directory, no permission, bad URL
        if is_unavailable(exc):
            raise StorageUnavailable(uri, str(exc)) from exc
        raise BadData(uri, f"cannot read quarantine file ({type(exc).__name__}: {exc})",
                      READ_FIX) from None
    entries = []
    for n, line in enumerate(raw.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            d = load_line(line, f"{uri}:{n}")
            sha = normalized_hash(d.get("sha256"))
        except ValueError:  # StoreRecordInvalid: not JSON, too deep, not finite, too long
            sha = None
        if sha is None:
            raise BadData(f"{uri}:{n}", f"line {n} is not a quarantine entry (a JSON object "
                          f"with a hex sha256 of at least {HASH_HEX} digits)",
                          "write it with the run that made it (runs/<run_id>/quarantine.jsonl) "
                          "or fix the line")
        entries.append(QuarantineEntry.from_json({**d, "sha256": sha}))
    return entries


def quarantined_hashes(uris: Iterable[str]) -> frozenset[str]:
    """Every hash the quarantine files at `uris` name (read_quarantine's errors)."""
    return frozenset(e.sha256 for uri in uris for e in read_quarantine(uri))


def _int(value: object, default: int | None) -> Any:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None
