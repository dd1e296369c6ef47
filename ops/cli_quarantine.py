"""`mainspring data quarantine RUN [--json]`: the documents a run's loss spikes were
diagnosed as caused by (storage/quarantine.py), each with the start of its text.

The list is derived from the run's durable event log, as `runs/<run_id>/quarantine.jsonl`
is, so it is current during a run too. Each document's text is decoded from the run's
dataset (its document number in the train split, the shards it lies in, the dataset's
tokenizer); where that is not there, it is read back from its source record (jsonl line,
parquet row, or the whole text file) and cleaned as data prep cleaned it (the run's stored
spec says how). Either is checked against the quarantined hash, then shown scrubbed of
secrets (common/redact.py), its control and format characters escaped, cut at
SNIPPET_CHARS. A source that cannot be read (moved, no credentials here) or that no longer
holds that text says so instead. No Temporal needed.

The event log is data, not an address list: a source is opened only when it lies under the
run's own `data.corpus` (its stored spec's) or its durable store, and the dataset only by
its content hash in that store (`source_refusal`, ops/store_fields.py:dataset_key). Any
other URL an event names (an internal `http://` address, `file:///dev/zero`) is shown
as OUTSIDE, never fetched.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from typing import Any, Callable

import structlog

from common.errors import BadConfig, BadData, StorageUnavailable
from common.redact import redact
from ops.cli_args import run_command
from ops.cli_output import json_line, printable
from ops.store_fields import checked_events

log = structlog.get_logger(__name__)
SNIPPET_CHARS = 80
NOT_READABLE = "(source not readable)"
CHANGED = "(source no longer holds this text)"
OUTSIDE = "(source not opened: outside the run's data.corpus and store)"


def register(sub: argparse._SubParsersAction) -> None:
    """Add `data quarantine RUN [--durable URL] [--json]`."""
    data = sub.add_parser("data", help="a run's data: its quarantined documents")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    p = run_command(data_sub, "quarantine",
                    "the documents a run's loss spikes were diagnosed as caused by")
    p.add_argument("--json", action="store_true", help="one JSON object per document and line")
    p.set_defaults(fn=cmd_quarantine)


def snippet(text: str, width: int = SNIPPET_CHARS) -> str:
    """Pure: `text` scrubbed of secrets, then control and format characters escaped (no
    terminal escape or bidi override reaches the screen), cut at `width` characters with
    an ellipsis."""
    return printable(redact(text), width)


def _root(url: str) -> str:
    """Pure: the location every file of a corpus URL lies under: the URL itself, or for a
    glob the directory before its first wildcard."""
    from dataprep.inputs import GLOB_CHARS, corpus_url
    from storage.fs import normalize_url

    url = normalize_url(corpus_url(url))
    cut = min((url.find(c) for c in GLOB_CHARS if c in url), default=-1)
    return url if cut < 0 else url[:cut].rsplit("/", 1)[0]


def source_refusal(source: str, corpus: str, durable_url: str) -> str | None:
    """Pure: why `source`, a URL read from the event log, must not be opened (None: it may
    be). Only a file under the run's `data.corpus` or its durable store may: an event
    names its source, it does not get to choose what the operator's machine fetches."""
    from storage.fs import normalize_url

    if not source or any(ch.isspace() or not ch.isprintable() for ch in source):
        return "not a plain URL"
    url = normalize_url(source)
    if any(part in (".", "..") for part in url.split("://", 1)[-1].split("/")):
        return "has a '.' or '..' segment"
    for root in (_root(corpus), normalize_url(durable_url)):
        if url == root or url.startswith(root.rstrip("/") + "/"):
            return None
    return "outside data.corpus and the run's store"


def source_text(source: str, record: int, sha256: str, data: Any) -> str | None:
    """The cleaned text of `record` of the input file `source` when it still has hash
    `sha256`; CHANGED when it does not; None when the file cannot be read."""
    from dataprep.clean import clean_text
    from dataprep.inputs import InputFile, read_file_documents
    from storage.fs import resolve

    try:
        fs, path = resolve(source)
        file = InputFile(path=path, url=source, size=0, fingerprint="")
        docs = read_file_documents(fs, file, data, {})
    except (BadData, StorageUnavailable, OSError, ValueError, ImportError) as exc:
        log.info("quarantine_source_not_readable", source=redact(source), error=redact(
            repr(exc)[:200]))
        return None
    name = source if record < 0 else f"{source}:{record}"
    raw = next((d.text for d in docs if d.source == name), None)
    if raw is None:
        return CHANGED
    text = clean_text(raw, data.cleaning.normalize)[0]
    return text if hashlib.sha256(text.encode()).hexdigest().startswith(sha256) else CHANGED


def run_dataset(durable_url: str, events: list[dict]) -> str | None:
    """The manifest URL of the dataset the run trained on: by content hash in this store
    only (the event's `content_hash`, else its manifest URI's directory name); a URI the
    event names is never opened itself. None when no content hash is recorded."""
    from ops.store_fields import dataset_key
    from storage.dataset import manifest_url

    ready = [e["payload"] for e in events if e["kind"] == "dataset_ready"]
    key = dataset_key(ready[-1]) if ready else None
    return manifest_url(durable_url, key) if key else None


def dataset_reader(manifest: str | None) -> Callable[[int, str], str | None]:
    """`read(document, sha256)`: the train split's document, decoded, when it has that hash;
    None when it does not or the dataset cannot be read (logged)."""
    from tokenizers import Tokenizer

    from storage.dataset import document_tokens, tokenizer_path
    from storage.fs import resolve

    tokenizer: list[Any] = []

    def read(document: int, sha256: str) -> str | None:
        if manifest is None or document < 0:
            return None
        try:
            if not tokenizer:
                fs, path = resolve(tokenizer_path(manifest))
                tokenizer.append(Tokenizer.from_str(fs.cat_file(path).decode()))
            ids = document_tokens(manifest, "train", document).tolist()
            text = tokenizer[0].decode(ids, skip_special_tokens=False)
        except Exception as exc:  # noqa: BLE001 - logged; the source is read instead
            log.info("quarantine_text_not_in_dataset", manifest=manifest, document=document,
                     error=repr(exc)[:200])
            return None
        return text if hashlib.sha256(text.encode()).hexdigest().startswith(sha256) else None

    return read


def run_data_config(durable_url: str, run_id: str) -> Any:
    """The run's data section (how its documents were read and cleaned); the defaults when
    its stored spec is missing or no longer reads."""
    from spec import DataConfig, RunSpec
    from storage.runs import stored_spec

    stored = stored_spec(durable_url, run_id)
    try:
        return RunSpec.from_dict(stored).data if stored else DataConfig()
    except BadConfig:
        return DataConfig()


def quarantine_rows(durable_url: str, run_id: str) -> tuple[list[dict[str, Any]], str]:
    """(one row per quarantined document, the run's quarantine file URI)."""
    from ops.report import missing_run
    from storage.events import read_events
    from storage.quarantine import quarantine_entries, quarantine_uri

    events = checked_events(read_events(durable_url, run_id))
    if not events:
        raise missing_run(durable_url, run_id)
    entries = quarantine_entries(events)
    data = run_data_config(durable_url, run_id) if entries else None
    from_dataset = dataset_reader(run_dataset(durable_url, events))
    rows = []
    for e in entries:
        text, where = from_dataset(e.document, e.sha256), "dataset"
        refusal = source_refusal(e.source, data.corpus, durable_url) if text is None else None
        if refusal:
            log.warning("quarantine_source_refused", source=printable(redact(e.source), 200),
                        why=refusal, corpus=redact(data.corpus))
            text, where = OUTSIDE, "source"
        elif text is None:
            text, where = source_text(e.source, e.record, e.sha256, data), "source"
        found = text not in (None, CHANGED, OUTSIDE)
        rows.append({"source": printable(redact(e.source), 500), "record": e.record,
                     "sha256": e.sha256,
                     "z": e.z, "loss": e.loss, "step": e.step, "document": e.document,
                     "chars": e.chars, "event_id": printable(e.event_id, 200),
                     "snippet": snippet(text) if found else text or NOT_READABLE,
                     "text_from": where if found else None})
    return rows, redact(quarantine_uri(durable_url, run_id))


def row_line(row: dict[str, Any]) -> str:
    """Pure: one document as a line of text."""
    where = row["source"] if row["record"] < 0 else f"{row['source']}:{row['record']}"
    z = f"{row['z']:.1f}" if row["z"] is not None else "?"
    text = f'"{row["snippet"]}"' if row["text_from"] else row["snippet"]
    return f"step {row['step']}  z {z}  sha256 {row['sha256']}  {where}\n    {text}"


def cmd_quarantine(args: argparse.Namespace) -> int:
    from common import telemetry
    from ops.report import exit_code

    telemetry.configure_logging(os.environ.get("MAINSPRING_LOG_LEVEL", "warning"))
    try:
        rows, uri = quarantine_rows(args.durable, args.run_id)
    except (BadConfig, StorageUnavailable) as exc:
        print(f"mainspring data quarantine: {printable(' '.join(redact(str(exc)).split()))}",
              file=sys.stderr)
        return exit_code(exc)
    if args.json:
        for row in rows:
            print(json_line(row))
        if not rows:  # stdout stays JSON lines (none); the person reading gets a word
            print(f"mainspring data quarantine: run {args.run_id} has no quarantined "
                  "documents", file=sys.stderr)
    elif not rows:
        print(f"run {args.run_id}: no quarantined documents — no loss spike was diagnosed "
              "as caused by documents the dataset's index names.")
    else:
        print(f"run {args.run_id}: {len(rows)} quarantined document"
              f"{'s' if len(rows) != 1 else ''} (data.quarantine: {uri})")
        for row in rows:
            print(row_line(row))
    return 0
