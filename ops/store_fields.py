"""The one place where the operator commands type- and range-check what they read from the
store before they use it: events (storage/events.py) and spans (storage/spans.py).

The bucket is data, not code (docs/security.md), and whoever can write to it can write an
event whose `ts` is 1e300 (an OverflowError in `time.gmtime`), a loss window from step 0
to 10^12 (a report that allocates per step runs out of memory), a string where a step or a
duration belongs (a TypeError in a sum), or a trial run id of `../other`. The readers keep
events that are well-formed JSON with the fields every reader indexes; these checks go one
step further, for the figures `events`, `explain`, `report`, `trace`, `goodput`, `sweep`
and `data quarantine` compute with:

- an event whose time, step, id or kind is out of range is dropped, once, with a warning
  (`operator_event_skipped`); a `train_metrics` window is drawn only when its steps are
  whole numbers in [0, MAX_STEP] with first <= last (`loss_window`);
- a payload field mainspring only ever writes as a number (NUMBER_FIELDS) is removed when
  it is not a finite number in its range: the commands already read such fields with
  `.get`, so a removed one reads as "not recorded";
- a span's times are whole nanoseconds in range or removed, its attributes an object, its
  events a list of objects.

Pure and stdlib only apart from structlog; no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import structlog

from common.limits import MAX_STEP
from common.store_json import MAX_DEPTH, too_deep

log = structlog.get_logger(__name__)

# Seconds since the epoch: up to 2286-11-20, far past any run and far inside what
# time.gmtime and datetime accept on every platform.
MAX_TS_S = 10**10
MAX_NS = MAX_TS_S * 10**9
# Durations, rates and counts: no figure mainspring records is near 2^53 (exact in a
# float); one beyond it is not a quantity it wrote.
MAX_QUANTITY = float(2**53)
# A run id read back from the store is checked as a user's run id is (spec/run.py).
RUN_ID_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")

_STEP = (0, MAX_STEP)
_COUNT = (0, MAX_QUANTITY)
_SECONDS = (0, MAX_QUANTITY)
_TIME = (0, MAX_TS_S)
_SIGNED = (-MAX_QUANTITY, MAX_QUANTITY)
# A dataset's content hash (dataprep/inputs.py: 16 hex digits; a full sha256 allowed).
CONTENT_HASH_RE = re.compile(r"[0-9a-f]{16,64}")
# Payload fields that are a number wherever mainspring writes them, with their range.
NUMBER_FIELDS: dict[str, tuple[float, float]] = {
    **dict.fromkeys(("first_step", "last_step", "from_step", "to_step", "at_step", "onset",
                     "resumed_step", "heartbeat_step", "last_step_seen", "source_step",
                     "accepted_at_step", "final_step", "until_step", "total_steps",
                     "lost_steps", "segment_steps"), _STEP),
    **dict.fromkeys(("attempt", "seq", "bytes", "documents", "nonfinite", "round",
                     "val_tokens", "train_tokens", "logits_bytes", "peak_mem_bytes",
                     "tokens_per_s", "repeats", "micro_batch", "grad_accum",
                     "global_batch_sequences", "chars", "document"), _COUNT),
    "record": (-1, MAX_QUANTITY),
    **dict.fromkeys(("mttr_s", "detection_s", "tail_s", "startup_s", "seconds_per_step",
                     "forward_s_per_step", "predicted_s", "seconds", "mttr_s_here"),
                    _SECONDS),
    **dict.fromkeys(("fault_ts", "detected_ts"), _TIME),
    **dict.fromkeys(("loss", "loss_mean", "loss_min", "loss_max", "baseline", "threshold",
                     "spread", "scale", "z", "lr", "mfu", "result"), _SIGNED),
}
# Lists of steps: only whole steps in range are kept.
STEP_LISTS = ("discarded", "outlier_steps", "skipped_steps")
# Lists of records (a diagnosis' documents): only objects are kept, each checked as a payload.
RECORD_LISTS = ("outliers", "sources")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def in_range(value: object, low: float, high: float) -> bool:
    """Pure: a finite number (not a bool) in [low, high]."""
    return _is_number(value) and math.isfinite(value) and low <= value <= high


def whole(value: object, low: int = 0, high: int = MAX_STEP) -> bool:
    """Pure: an int (not a bool) in [low, high]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def valid_run_id(value: object) -> bool:
    """Pure: a run id as a user may name one (spec/run.py's rule): never `../x` or a URL."""
    return isinstance(value, str) and RUN_ID_RE.fullmatch(value) is not None


def dataset_key(ready: Mapping[str, Any], uri: object = None) -> str | None:
    """Pure: the content hash of the dataset a run's `dataset_ready` payload names (its
    `content_hash`, else the directory of its manifest `uri`, else of `uri`): a
    `CONTENT_HASH_RE` name, so the manifest is looked up in the run's own store and
    nowhere else; None when no such name is recorded."""
    for value in (ready.get("content_hash"), ready.get("uri"), uri):
        if isinstance(value, str) and value.endswith("/MANIFEST.json"):
            value = value.rsplit("/", 2)[-2]
        if isinstance(value, str) and CONTENT_HASH_RE.fullmatch(value):
            return value
    return None


def checked_payload(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Pure: `payload` without the number fields that are not numbers in their range, its
    step lists holding whole steps only, and an `eval` stage's `val_loss` map holding
    finite losses at whole steps only."""
    out = {}
    for key, value in payload.items():
        bounds = NUMBER_FIELDS.get(key)
        if bounds is not None and value is not None and not in_range(value, *bounds):
            continue
        if key in STEP_LISTS and value is not None:
            value = [s for s in value if whole(s)] if isinstance(value, list) else []
        if key == "skip" and value is not None and not (
                isinstance(value, list) and len(value) == 2 and all(map(whole, value))):
            continue  # a rollback's skipped data window: [first batch, end batch]
        if key in RECORD_LISTS and value is not None:
            value = [checked_payload(r) for r in value if isinstance(r, dict)] \
                if isinstance(value, list) else []
        if key == "val_loss" and isinstance(value, dict):
            value = {k: v for k, v in value.items() if isinstance(k, str) and k.isascii()
                     and k.isdigit() and len(k) <= 13 and whole(int(k))
                     and in_range(v, *_SIGNED)}
        elif key == "val_loss" and value is not None and not in_range(value, *_SIGNED):
            continue
        out[key] = value
    return out


def event_problem(event: Mapping[str, Any]) -> str | None:
    """Pure: why an event cannot be used by an operator command, or None."""
    if not isinstance(event.get("event_id"), str) or not isinstance(event.get("kind"), str):
        return "event_id or kind is not a string"
    if not in_range(event.get("ts"), *_TIME):
        return f"ts is not a time in [0, {MAX_TS_S}]"
    if event.get("step") is not None and not whole(event.get("step")):
        return f"step is not a whole number in [0, {MAX_STEP}]"
    payload = event.get("payload")
    if not isinstance(payload, dict):
        return "payload is not an object"
    if too_deep(payload):
        return f"payload nested deeper than {MAX_DEPTH} levels"
    return None


def loss_window(event: Mapping[str, Any]) -> bool:
    """Pure: a checked `train_metrics` event that is a usable window: its first and last
    steps whole numbers in range, first <= last (an older or damaged one is listed by
    `events` but drawn nowhere)."""
    p = event["payload"]
    first, last = p.get("first_step"), p.get("last_step")
    return (event["kind"] == "train_metrics" and whole(first) and whole(last)
            and first <= last)


def checked_events(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Events an operator command can compute with: out-of-range ones dropped (one warning
    naming the first), number fields checked (`checked_payload`). Order is kept."""
    out, dropped = [], []
    for event in events:
        problem = event_problem(event) if isinstance(event, Mapping) else "not an object"
        if problem is None:
            out.append({**event, "payload": checked_payload(event["payload"])})
        else:
            dropped.append((str(event.get("event_id"))[:80] if isinstance(event, Mapping)
                            else "?", problem))
    if dropped:
        log.warning("operator_event_skipped", count=len(dropped), event_id=dropped[0][0],
                    problem=dropped[0][1])
    return out


def _ns(value: object) -> bool:
    return whole(value, 0, MAX_NS)


def checked_span(span: Mapping[str, Any]) -> dict[str, Any]:
    """Pure: a stored span with its times whole nanoseconds in range (else removed), its
    ids, name and service strings, attributes an object with checked number fields, its
    events a list of objects with checked times and attributes."""
    out = {k: v for k, v in span.items() if k not in ("start_ns", "end_ns")}
    for key in ("start_ns", "end_ns"):
        if _ns(span.get(key)):
            out[key] = span[key]
    for key in ("parent_id", "parent_hint", "trace_id"):
        if not isinstance(out.get(key), str):
            out[key] = None if key != "trace_id" else ""
    for key in ("name", "service", "status", "status_message"):
        if key in out and not isinstance(out[key], str):
            out[key] = str(out[key])[:200]
    attrs = span.get("attributes")
    out["attributes"] = _span_attributes(attrs) if isinstance(attrs, dict) else {}
    out["events"] = [{**e, "ts_ns": e["ts_ns"] if _ns(e.get("ts_ns")) else None,
                      "name": str(e.get("name", "?")),
                      "attributes": checked_payload(e["attributes"])
                      if isinstance(e.get("attributes"), dict) else {}}
                     for e in span.get("events") or () if isinstance(e, dict)] \
        if isinstance(span.get("events"), list) else []
    out["links"] = [x for x in span.get("links") or () if isinstance(x, dict)] \
        if isinstance(span.get("links"), list) else []
    return out


def _span_attributes(attrs: dict[str, Any]) -> dict[str, Any]:
    """A span's attributes checked as a payload; a `steps a-b` window's step times kept
    only as a list of finite, non-negative seconds."""
    out = checked_payload(attrs)
    times = out.get("step_times_s")
    if times is not None and not (isinstance(times, list)
                                  and all(in_range(t, *_SECONDS) for t in times)):
        del out["step_times_s"]
    if not (whole(out.get("first_step")) and whole(out.get("last_step"))):
        out.pop("step_times_s", None)  # a window with no steps to put its times at
    return out


def checked_spans(spans: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Spans an operator command can compute with: each one with a string span id,
    `checked_span`; the rest dropped with one warning."""
    good, dropped = [], 0
    for span in spans:
        if isinstance(span, Mapping) and isinstance(span.get("span_id"), str) \
                and not too_deep(span, MAX_DEPTH + 2):
            good.append(checked_span(span))
        else:
            dropped += 1
    if dropped:
        log.warning("operator_span_skipped", count=dropped,
                    problem="no string span_id, or nested too deeply")
    return good
