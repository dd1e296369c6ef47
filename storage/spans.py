"""A run's spans in the durable store: `runs/<run_id>/spans/<writer>-<seq>.jsonl`, immutable
batch objects written whole or not at all (put_new), like the event log (storage/events.py).

Every process that traces exports its finished spans here (common/telemetry.py adds a
`DurableSpanExporter`), whichever client started the run: the store a span goes to is the
run its trace belongs to. A process of one run (a trainer rank, the checkpoint writer)
knows its run from the start; a worker serves many, so each activity `bind`s its trace
to its run when it starts, and spans of a trace not bound yet wait (bounded) until it is.

One line per span, the `SpanRecord` layout (common/telemetry.py:span_record):
`{trace_id, span_id, parent_id, name, start_ns, end_ns, status, status_message, service,
pid, parent_hint, attributes, events: [{name, ts_ns, attributes}], links: [{trace_id,
span_id}]}`. Readers merge every batch and drop repeated span ids (a workflow task that
ran twice emits its spans twice): `read_spans`.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Sequence

import structlog
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from common.store_json import field_int, field_str, load_line
from common.telemetry import span_record
from storage.fs import join, put_new, resolve, storage_errors

log = structlog.get_logger(__name__)

PENDING_MAX = 20_000  # spans of traces not bound to a run yet, kept at most this many
PENDING_TTL_S = 900.0  # ... and this long; then only the local span file has them


def spans_root(root: str, run_id: str) -> str:
    return join(root, "runs", run_id, "spans")


class DurableSpanExporter(SpanExporter):
    """Finished spans into their run's `spans/` directory, one batch object per export per
    run. Thread-safe. `run=(durable_url, run_id)`: a process of one run, every span goes
    there; otherwise spans are routed by trace id (`bind`)."""

    def __init__(self, service: str, run: tuple[str, str] | None = None) -> None:
        self.writer = f"{service}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.default = run
        self.routes: dict[str, tuple[str, str]] = {}
        self.pending: list[tuple[float, dict]] = []
        # batches the store refused (an outage): written again with the next export
        self.unsent: list[tuple[str, str, list[dict]]] = []
        self._seq = 0
        self._lock = threading.Lock()

    def bind(self, trace_id: str, durable_url: str, run_id: str) -> None:
        """Spans of `trace_id` (32 hex digits) go to `run_id`'s store from now on, and so do
        those of it already waiting."""
        if not trace_id or int(trace_id, 16) == 0:
            return
        with self._lock:
            self.routes[trace_id] = (durable_url, run_id)
            if len(self.routes) > 10_000:  # a worker's lifetime of runs: drop the oldest
                self.routes.pop(next(iter(self.routes)))
            ready = [r for _, r in self.pending if r["trace_id"] == trace_id]
            self.pending = [(t, r) for t, r in self.pending if r["trace_id"] != trace_id]
        if ready:
            self._write(durable_url, run_id, ready)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        by_run: dict[tuple[str, str], list[dict]] = {}
        now = time.time()
        with self._lock:
            for span in spans:
                rec = span_record(span)
                route = self.routes.get(rec["trace_id"]) or self.default
                if route is None:
                    self.pending.append((now, rec))
                else:
                    by_run.setdefault(route, []).append(rec)
            self.pending = [(t, r) for t, r in self.pending if now - t < PENDING_TTL_S]
            del self.pending[:-PENDING_MAX]
        with self._lock:
            batches, self.unsent = self.unsent, []
        batches += [(url, run_id, recs) for (url, run_id), recs in by_run.items()]
        ok = True
        for url, run_id, recs in batches:
            ok = self._write(url, run_id, recs) and ok
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def _write(self, durable_url: str, run_id: str, recs: list[dict]) -> bool:
        with self._lock:
            seq, self._seq = self._seq, self._seq + 1
        body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in recs).encode()
        try:
            fs, root = resolve(durable_url)
            directory = spans_root(root, run_id)
            fs.makedirs(directory, exist_ok=True)
            put_new(fs, join(directory, f"{self.writer}-{seq:06d}.jsonl"), body)
            return True
        except Exception as exc:  # never let tracing break the work it traces
            with self._lock:  # kept for the next export (a repeat on read is dropped)
                self.unsent.append((durable_url, run_id, recs))
                while sum(len(b[2]) for b in self.unsent) > PENDING_MAX:
                    self.unsent.pop(0)
            log.warning("spans_not_stored_yet", run_id=run_id, spans=len(recs),
                        error=repr(exc)[:200])
            return False

    def shutdown(self) -> None:
        pass


def read_spans(durable_url: str, run_id: str) -> list[dict]:
    """Every stored span of a run, one per span id, ordered by start time."""
    fs, root = resolve(durable_url)
    directory = spans_root(root, run_id)
    try:
        fs.invalidate_cache()
        paths = sorted(p for p in fs.ls(directory, detail=False) if p.endswith(".jsonl")) \
            if fs.exists(directory) else []
    except storage_errors() as exc:
        from common.errors import StorageUnavailable

        raise StorageUnavailable(directory, repr(exc)) from exc
    best: dict[str, dict] = {}
    for path in paths:
        try:
            data = fs.cat_file(path)
        except FileNotFoundError:
            continue
        for raw in data.split(b"\n"):
            if not raw.strip():
                continue
            try:
                rec = load_line(raw, path)
                start = field_int(rec, "start_ns", path, default=0)
                span_id = field_str(rec, "span_id", path, max_len=64)
            except ValueError as exc:  # StoreRecordInvalid
                log.warning("span_line_unreadable", path=path, error=str(exc)[:200])
                continue
            best.setdefault(span_id, {**rec, "start_ns": start})
    return sorted(best.values(), key=lambda r: (r["start_ns"], r["span_id"]))
