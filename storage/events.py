"""Append-only event log (DESIGN §3).

Writers buffer events and put immutable batch objects under `runs/<run_id>/events/`;
nothing is ever rewritten. Each writer id is unique per process, so two writers never race
for one object. An `event_id` given by the caller makes an event idempotent across activity
retries: readers merge all batches, drop repeated ids (the earliest (ts, writer) copy wins,
whatever the listing order) and order by (ts, event_id). Batches are written whole or not at
all (put_new).

Each batch is named with the span of its events' times and whether it holds an incident
or milestone (storage/event_batches.py), so a reader of a window or of those kinds fetches
only the batches it needs; older code's names say nothing and are always read.

A reader never fails on a damaged batch: a line that is not UTF-8 JSON, or not
an event (`well_formed`: an object with a string `event_id` and `kind`, a finite number
`ts`, an object `payload` and an integer-or-null `step`), is skipped with a
`event_line_unreadable` log line, and the batch then yields one synthetic
`event_log_damaged` event — event_id `event_log_damaged/<batch file name>` (the same on
every read, so it dedupes), payload {path, lines_skipped, example: the first bad line's
first 200 characters}, ts the batch's newest good event's (or the object's mtime) — so the
loss is visible in `mainspring events`, reports and the timeline, never silent.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import structlog
from opentelemetry import trace

from common.errors import StorageUnavailable
from common.redact import redact_value
from common.store_json import load_line
from common.telemetry import current_trace_id
from storage.event_batches import (
    FOLLOW_GROUP,
    Batch,
    batch_name,
    merge,
    parse_batch,
    select,
    sweep,
)
from storage.fs import (
    is_unavailable,
    join,
    keep_cached,
    put_new,
    read_cached,
    resolve,
    storage_errors,
)

log = structlog.get_logger(__name__)


def events_root(root: str, run_id: str) -> str:
    return join(root, "runs", run_id, "events")


class EventLog:
    """One writer's view of a run's event log. Thread-safe; call flush() at commit points."""

    def __init__(self, durable_url: str, run_id: str, writer: str, *, attempt: int = 0,
                 trace_id: str = "") -> None:
        self.fs, root = resolve(durable_url)
        self.url, self.run_id, self.attempt = durable_url, run_id, attempt
        self.trace_id = trace_id or current_trace_id()
        self.writer = f"{writer}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.dir = events_root(root, run_id)
        self._buffer: list[dict[str, Any]] = []
        self._seq = 0
        self._lock = threading.Lock()

    def emit(self, kind: str, payload: Mapping[str, Any] | None = None, /, *,
             step: int | None = None, event_id: str | None = None,
             **fields: Any) -> dict[str, Any]:
        """Buffer one event of `kind` at `step`; `event_id` makes it idempotent (module doc).

        The payload is `fields` over `payload`, as `dict(payload, **fields)` merges them:
        `kind` and `payload` are positional-only, so a fault's payload may carry a `kind`
        of its own; a payload handed on whole (a workflow's record_event) goes in the
        mapping, where `step` and `event_id` are payload keys like any other. It is
        scrubbed of secrets first (common/redact.py): the log is kept for the life of the
        run and read by anyone who can read the bucket."""
        payload = redact_value({**(payload or {}), **fields})
        event = {
            "event_id": event_id or uuid.uuid4().hex,
            "run_id": self.run_id,
            "kind": kind,
            "ts": time.time(),
            "step": step,
            "attempt": self.attempt,
            "trace_id": self.trace_id,
            "writer": self.writer,
            "payload": payload,
        }
        with self._lock:
            self._buffer.append(event)
        span = trace.get_current_span()  # the event is also a span event where it happened
        if span.is_recording():
            span.add_event(kind, span_event_attributes(event))
        log.info("event_recorded", kind=kind, step=step,
                 payload={k: v for k, v in payload.items() if isinstance(v, (int, float, str))})
        return event

    def flush(self) -> None:
        """Write the buffered events as one new immutable object."""
        with self._lock:
            if not self._buffer:
                return
            batch, self._buffer = self._buffer, []
            path = join(self.dir, batch_name(f"{self.writer}-{self._seq:06d}", batch))
            self._seq += 1
        body = "".join(json.dumps(e, sort_keys=True) + "\n" for e in batch)
        try:
            self.fs.makedirs(self.dir, exist_ok=True)
            put_new(self.fs, path, body.encode())  # whole or absent, never rewritten
        except FileExistsError:
            log.warning("event_batch_exists", path=path)  # our earlier put landed after all
        except Exception as exc:
            with self._lock:  # keep them for the next flush rather than losing them
                self._buffer[:0] = batch
            if is_unavailable(exc):
                raise StorageUnavailable(self.url, repr(exc)) from exc
            raise

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()


def span_event_attributes(event: Mapping[str, Any]) -> dict[str, Any]:
    """Pure: an event as span-event attributes: its id and step, and the payload's scalar
    fields (strings cut at 500 characters; a span is no place for a log tail)."""
    out: dict[str, Any] = {"event_id": event["event_id"]}
    if event.get("step") is not None:
        out["step"] = event["step"]
    for key, value in event["payload"].items():
        if isinstance(value, str):
            out[key] = value[:500]
        elif isinstance(value, (bool, int, float)):
            out[key] = value
    return out


def list_batches(durable_url: str, run_id: str) -> list[Batch]:
    """The run's batches, one listing, each with what its name says (`parse_batch`)."""
    fs, root = resolve(durable_url)
    return [parse_batch(p) for p in _batches(fs, events_root(root, run_id))]


def load_batches(durable_url: str, run_id: str, batches: Iterable[Batch],
                 cache_dir: str | None = None) -> list[list[dict]]:
    """The events of each of `batches` (damaged lines as `_events` says), for `merge`."""
    fs, _ = resolve(durable_url)
    return list(_load_many(fs, [b.path for b in batches], run_id, cache_dir))


def read_events(durable_url: str, run_id: str, kinds: tuple[str, ...] = (),
                cache_dir: str | None = None, *, since: float | None = None,
                until: float | None = None) -> list[dict]:
    """Merged, deduplicated, ordered events of a run (the same answer whatever the listing
    order: of repeated event_ids the earliest (ts, writer) copy wins; order is (ts, event_id)),
    only those of `kinds` if given, and with times in [since, until] if given.

    One listing, then only the batches whose names do not rule them out (`select`) fetched,
    concurrently (a run's log holds thousands: one GET after another cost a restart seconds).
    A read that skips batches dedupes among those it reads: an id's copy in a skipped batch
    lies outside the window or is of another kind. With `cache_dir` (a trainer machine's
    fast tier) each batch is fetched once: batches are immutable, so a copy kept there is
    read instead next time."""
    chosen = select(list_batches(durable_url, run_id), since=since, until=until, kinds=kinds)
    events = merge(load_batches(durable_url, run_id, chosen, cache_dir))
    return [e for e in events if (not kinds or e["kind"] in kinds)
            and (since is None or e["ts"] >= since) and (until is None or e["ts"] <= until)]


def follow(durable_url: str, run_id: str, *, poll_s: float = 1.0,
           stop: Callable[[], bool] = lambda: False,
           group: int = FOLLOW_GROUP) -> Iterator[dict]:
    """Tail a run's log: yield each new event once (by event_id), as it comes, until stop().

    Each poll reads the batches not read before, `group` at a time (`sweep`): the first
    one, the catch-up of a long run's log, holds a group's events at once (and those of
    batches that span past it), never the log's; only the ids seen are kept. Order: the
    batches whose names give their span (`batch_name`) in (ts, event_id) order, read_events'
    order, within a poll; an older writer's batches (no span in the name) first, ordered
    within each group of them. A batch flushed late by a slow writer can carry events older
    than ones a poll before yielded (read_events gives the total order).
    """
    fs, root = resolve(durable_url)
    directory = events_root(root, run_id)
    seen_paths: set[str] = set()
    seen_ids: set[str] = set()
    while True:
        fresh = [parse_batch(p) for p in _batches(fs, directory) if p not in seen_paths]
        seen_paths.update(b.path for b in fresh)
        for event in sweep(fresh, lambda paths: _load_many(fs, paths, run_id), group):
            if event["event_id"] not in seen_ids:
                seen_ids.add(event["event_id"])
                yield event
        if stop():
            return
        time.sleep(poll_s)


def stream_events(durable_url: str, run_id: str, *,
                  group: int = FOLLOW_GROUP) -> Iterator[dict]:
    """read_events' answer in its order, holding a group of batches at a time (`sweep`)
    where every batch's name gives its span; a log with one that does not (older code's)
    is read whole first, as read_events reads it. (Out of order only where a name does not
    bound its batch's times: one that lies, or a damaged batch with no good line, dated by
    its object's time.)"""
    batches = list_batches(durable_url, run_id)
    if any(b.first is None for b in batches):
        yield from merge(load_batches(durable_url, run_id, batches))
        return
    fs, _ = resolve(durable_url)
    seen: set[str] = set()
    for event in sweep(batches, lambda paths: _load_many(fs, paths, run_id), group):
        if event["event_id"] not in seen:
            seen.add(event["event_id"])
            yield event


def _batches(fs, directory: str) -> list[str]:
    try:
        fs.invalidate_cache()
        if not fs.exists(directory):
            return []
        return sorted(p for p in fs.ls(directory, detail=False) if p.endswith(".jsonl"))
    except storage_errors() as exc:
        raise StorageUnavailable(directory, repr(exc)) from exc


DAMAGED = "event_log_damaged"


def _load_many(fs, paths: list[str], run_id: str = "",
               cache_dir: str | None = None) -> Iterator[list[dict]]:
    """Each batch's events (`_events`), fetched concurrently, through `cache_dir` if given."""
    kept = {p: read_cached(cache_dir, os.path.basename(p)) for p in paths} if cache_dir else {}
    fetched = _fetch(fs, [p for p in paths if kept.get(p) is None])
    for path in paths:
        data = kept.get(path)
        if data is None:
            data = fetched.get(path)
            if data is None:
                continue  # listed, then gone (never, for an append-only log; a test's rm)
            if cache_dir:
                keep_cached(cache_dir, os.path.basename(path), data)
        yield _events(fs, path, data, run_id)


def _fetch(fs, paths: list[str]) -> dict[str, bytes]:
    if not paths:
        return {}
    try:
        got = fs.cat(paths, on_error="return")
    except storage_errors() as exc:
        raise StorageUnavailable(paths[0], repr(exc)) from exc
    out: dict[str, bytes] = {}
    for path, data in got.items():
        if isinstance(data, FileNotFoundError):
            continue
        if isinstance(data, BaseException):
            if is_unavailable(data):
                raise StorageUnavailable(path, repr(data)) from data
            raise data
        out[fs._strip_protocol(path)] = data
    return {p: out[fs._strip_protocol(p)] for p in paths if fs._strip_protocol(p) in out}


def _load(fs, path: str, run_id: str = "") -> list[dict]:
    """A batch's well-formed events, plus one `event_log_damaged` event if any line was not."""
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return []
    return _events(fs, path, data, run_id)


def _events(fs, path: str, data: bytes, run_id: str) -> list[dict]:
    events, bad = _parse(data, path)
    if not bad:
        return events
    newest = max((e["ts"] for e in events), default=None)
    return [*events, damaged_event(path, run_id, bad, _mtime(fs, path) if newest is None
                                   else newest)]


def _parse(data: bytes, path: str = "") -> tuple[list[dict], list[str]]:
    """(well-formed events, bad lines) of one batch; each bad line is logged."""
    good, bad = [], []
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            # a measured NaN (a diverged loss) is written as the writer's json.dumps puts it
            # and read as null, as `events --json` prints it: the event stays in the record
            event = load_line(raw, path, nonfinite_null=True)
        except ValueError:  # StoreRecordInvalid: a torn tail of a pre-atomic writer, bad bytes,
            event = None  # too deep, an over-long number
        if well_formed(event):
            good.append(event)
            continue
        line = raw.decode("utf-8", errors="replace")
        bad.append(line)
        log.warning("event_line_unreadable", path=path, line=line[:200])
    return good, bad


def well_formed(event: object) -> bool:
    """Pure: has the fields every reader indexes, with their types (module docstring)."""
    if not isinstance(event, dict):
        return False
    ts = event.get("ts")
    step = event["step"] if "step" in event else "missing"  # present; int or null
    return (isinstance(event.get("event_id"), str) and bool(event["event_id"])
            and isinstance(event.get("kind"), str) and bool(event["kind"])
            and isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts)
            and isinstance(event.get("payload"), dict)
            and (step is None or (isinstance(step, int) and not isinstance(step, bool))))


def damaged_event(path: str, run_id: str, bad: list[str], ts: float) -> dict:
    """Pure: the synthetic event that stands for a batch's skipped lines."""
    return {"event_id": f"{DAMAGED}/{path.rsplit('/', 1)[-1]}", "run_id": run_id,
            "kind": DAMAGED, "ts": ts, "step": None, "attempt": 0, "trace_id": "",
            "writer": "reader",
            "payload": {"path": path, "lines_skipped": len(bad), "example": bad[0][:200]}}


def _mtime(fs, path: str) -> float:
    """When a batch with no readable event was written (0.0 where the store cannot say)."""
    try:
        return fs.modified(path).timestamp()
    except (NotImplementedError, OSError, AttributeError) as exc:
        log.warning("event_batch_time_unknown", path=path, error=repr(exc)[:200])
        return 0.0
