"""What an event batch's name says, and the pure choices a reader makes from it
(storage/events.py reads and writes the batches).

A batch's name says what it holds, so a reader that wants one time window, or only the
incidents, lists once and fetches only the batches it needs (a 30-day run holds thousands):
`<writer>-<seq>.<first_ms>-<last_ms>[.m].jsonl` — the milliseconds of its oldest and newest
event, and `.m` where it holds a MARKED kind (an incident `mainspring explain` tells, a run
or stage milestone, what a restart reads). A name without them — older code's
`<writer>-<seq>.jsonl`, or one that does not parse (names are store data, never trusted:
docs/security.md) — says nothing, and its batch is read by every reader. A reader of a
window still keeps only the events in it; a batch whose name lies about its span or kinds
can hide its events from such a reader (or put them out of a stream's order), as any
writer to the bucket could by not writing them.

Pure and stdlib only.
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The kinds a `.m` batch name marks: the incidents `mainspring explain` numbers and tells
# (ops/explain.py), the run's and stages' milestones, and what a trainer's start-up reads
# (trainer/segment.py STARTUP_EVENTS; the supervisor's faults and recoveries): rare events
# that readers look for across a whole run. A read of these kinds alone skips every batch
# whose name says it holds none of them (tests hold the readers' kinds to this set).
MARKED_KINDS = frozenset({
    "fault", "recovered", "loss_spike", "batch_skipped", "spike_diagnosed", "rollback",
    "operator", "needs_attention", "oom_adapted", "lr_adjusted", "checkpoint_corrupt",
    "checkpoint_failed", "run_started", "run_finished", "stage_started", "stage_finished",
    "rollback_refused", "oscillation_detected"})
# Up to 16 digits of milliseconds (year 2286 needs 13): a name never grows without bound.
_SPAN_NAME = re.compile(r"\.([0-9]{1,16})-([0-9]{1,16})(\.m)?\.jsonl\Z")  # ASCII digits only
_MAX_MS = 10**16 - 1


@dataclass(frozen=True, slots=True)
class Batch:
    """One listed batch object and what its name says: the span of its events' times in
    seconds (`first`, `last`: None where the name does not say) and whether it holds a
    MARKED kind (None where the name does not say)."""

    path: str
    first: float | None = None
    last: float | None = None
    marked: bool | None = None


def batch_name(stem: str, events: Sequence[Mapping[str, Any]]) -> str:
    """Pure: the object name of a batch of `events` (module docstring): `stem` with the
    span of their times and the MARKED flag; `stem.jsonl` alone where a time cannot be
    written as whole milliseconds in range (then every reader reads it, as an old one)."""
    times = [e["ts"] for e in events]
    if not times or not all(isinstance(t, (int, float)) and math.isfinite(t) for t in times):
        return f"{stem}.jsonl"
    first, last = math.floor(min(times) * 1000), math.ceil(max(times) * 1000)
    if first < 0 or last > _MAX_MS:
        return f"{stem}.jsonl"
    mark = ".m" if any(e["kind"] in MARKED_KINDS for e in events) else ""
    return f"{stem}.{first}-{last}{mark}.jsonl"


def parse_batch(path: str) -> Batch:
    """Pure: what a listed batch's name says (`batch_name`), its span widened by a
    millisecond either side (a float time times 1000 can round onto the next whole one);
    a name that does not parse, or whose span runs backwards, says nothing and is read by
    every reader."""
    m = _SPAN_NAME.search(path.rsplit("/", 1)[-1])
    if m is None:
        return Batch(path)
    first, last = int(m[1]), int(m[2])
    if first > last:
        return Batch(path)
    return Batch(path, (first - 1) / 1000, (last + 1) / 1000, m[3] is not None)


def select(batches: Iterable[Batch], *, since: float | None = None,
           until: float | None = None, kinds: Iterable[str] = ()) -> list[Batch]:
    """Pure: the batches a read of the events of `kinds` (all, if none) with times in
    [since, until] must fetch: each one whose name does not rule it out (its span misses
    the window, or every kind asked is MARKED and it is not marked)."""
    marked_only = bool(kinds) and set(kinds) <= MARKED_KINDS
    out = []
    for b in batches:
        if b.first is not None and ((since is not None and b.last < since)
                                    or (until is not None and b.first > until)):
            continue
        if marked_only and b.marked is False:
            continue
        out.append(b)
    return out


def merge(batches: Iterable[Iterable[dict]]) -> list[dict]:
    """Pure: dedupe by event_id (earliest (ts, writer) copy wins), order by (ts, event_id)."""
    best: dict[str, dict] = {}
    for batch in batches:
        for event in batch:
            old = best.get(event["event_id"])
            if old is None or _rank(event) < _rank(old):
                best[event["event_id"]] = event
    return sorted(best.values(), key=lambda e: (e["ts"], e["event_id"]))


# Batches fetched at once by `follow`: enough to keep a store's round trips few (one
# concurrent fetch of 64), few enough that a 30-day log (~2,000 batches, 26 MB) is never
# held whole.
FOLLOW_GROUP = 64


def sweep(batches: Iterable[Batch], load: Callable[[list[str]], Iterable[Iterable[dict]]],
          group: int = FOLLOW_GROUP) -> Iterator[dict]:
    """The events of `batches`, loaded `group` batches at a time by `load` (paths -> each
    one's events), yielded as soon as no batch still unloaded can hold an older one.

    The batches without a span in their name come first, a group at a time, each group
    in (ts, event_id) order. Then those with one, in order of their first time: after each
    group, the events older than the next unloaded batch's first time are yielded in
    (ts, event_id, writer) order — the earliest copy of an id first, as merge keeps it —
    and the rest wait for the next group. Repeated ids are yielded as often as loaded."""
    if group < 1:
        raise ValueError(f"group: {group} batches; read at least 1 at a time")
    batches = list(batches)
    unnamed = [b for b in batches if b.first is None]
    spanned = sorted((b for b in batches if b.first is not None),
                     key=lambda b: (b.first, b.path))
    for i in range(0, len(unnamed), group):
        yield from merge(load([b.path for b in unnamed[i:i + group]]))
    waiting: list[tuple] = []
    tie = itertools.count()
    for i in range(0, len(spanned), group):
        for batch in load([b.path for b in spanned[i:i + group]]):
            for e in batch:
                heapq.heappush(waiting, (e["ts"], e["event_id"], str(e.get("writer", "")),
                                         next(tie), e))
        bound = spanned[i + group].first if i + group < len(spanned) else math.inf
        while waiting and waiting[0][0] < bound:
            yield heapq.heappop(waiting)[-1]


def _rank(event: dict) -> tuple:
    return (event["ts"], str(event.get("writer", "")))
