"""Which fault a segment's retry answers, from the durable record: one fault, one recovery.

A fault is open until a `recovered` closes it (names it as its `fault_event_id`, or among its
`also_answers`); that is a fact of the run's event log, not of any one process's memory. A
`recovered` closes an open fault and no other. A segment execution's faults have the ids
`fault/<lo>-<hi>/<execution>/<launch>` (activities/recovery.py `fault_id`), the launch being
`N` for attempt N's first launch and `N.k` for its k-th restart in place (common/protocol.py
`launch_tag`).

So attempt N+1 reads attempt N's end from the log and the heartbeat together (`answer`):
- attempt N's last launch is the newest one either shows: the heartbeat's `restart`, or a
  recorded fault `N.k` (launch k ran), or a closed one (its restart in place, k+1, ran);
- that launch's own fault, recorded by the supervisor (in the log, or only in the heartbeat
  when the log's write failed), is what the retry's `recovered` closes;
- none: the launch ended with no record of its own (its worker was killed, its machine
  lost), so the retry writes a `worker_lost` under that launch's id before its recovery. A
  fault an in-place recovery already closed is never named again.
The execution's other open faults (a restart that died before its first step, an earlier
retry's lost worker, the decided fault the segment was scheduled after) are closed with it
(`also_answers`).

Pure functions; the event log is read by the caller (activities/recovery.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import structlog

from common.faults import Fault, recovered_id
from common.protocol import launch_tag
from common.store_json import StoreRecordInvalid, field_float, field_int, field_str

log = structlog.get_logger(__name__)

RECOVERED_PREFIX = recovered_id("")
MAX_ALSO = 64  # a recovered event's also_answers: mainspring writes a handful at most
MAX_RESTART = 10_000  # far above activities/launch.py IN_PLACE_RESTARTS


@dataclass(frozen=True)
class Ledger:
    """A segment execution's faults by id (`faults`), and every fault id the run's
    `recovered` events close (`closed`, the whole run's: a decided fault is of another
    execution)."""

    faults: Mapping[str, Fault] = field(default_factory=dict)
    closed: frozenset[str] = frozenset()

    def is_open(self, event_id: str) -> bool:
        return event_id not in self.closed


@dataclass(frozen=True)
class Answer:
    """What a retry's `recovered` closes: `event_id` ("": nothing, its decided fault is
    already closed), its record `fault` (None with an event_id: a worker_lost the retry
    writes first, under that id, for the previous attempt's launch `launch`), and the other
    open faults it closes with it (`also`)."""

    event_id: str = ""
    fault: Fault | None = None
    also: tuple[str, ...] = ()
    launch: int = 0

    @property
    def worker_lost(self) -> bool:
        return self.fault is None and bool(self.event_id)


def segment_prefix(from_step: int, to_step: int, execution: str) -> str:
    """Pure: the id prefix of one segment execution's faults."""
    return f"fault/{from_step}-{to_step}/{execution}/"


def launch_of(event_id: str, prefix: str, attempt: int) -> int | None:
    """Pure: k for the id of attempt `attempt`'s k-th launch (0: its first); None for any
    other id."""
    if not event_id.startswith(prefix):
        return None
    head, dot, k = event_id[len(prefix):].partition(".")
    if head != str(attempt):
        return None
    if not dot:
        return 0
    return int(k) if k.isdigit() and len(k) <= 5 else None


def closes(event: Mapping) -> set[str]:
    """Pure: the fault ids one `recovered` event closes (its id names its fault; the
    payload's also_answers the rest). A malformed also_answers closes nothing more."""
    out = set()
    if event["event_id"].startswith(RECOVERED_PREFIX):
        out.add(event["event_id"][len(RECOVERED_PREFIX):])
    try:
        out.add(field_str(event["payload"], "fault_event_id", "recovered",
                          max_len=512, default=""))
    except StoreRecordInvalid as exc:
        log.warning("recovered_record_unreadable", event_id=event["event_id"][:200],
                    error=str(exc)[:200])
    also = event["payload"].get("also_answers")
    if isinstance(also, list) and len(also) <= MAX_ALSO:
        out |= {a for a in also if isinstance(a, str) and len(a) <= 512}
    out.discard("")
    return out


def fault_of(event: Mapping) -> Fault | None:
    """Pure: a `fault` event's record, under its event id; None (logged) when the payload
    is not a fault mainspring wrote (the numbers a recovery computes with are checked)."""
    payload = event["payload"]
    try:
        for key in ("last_step", "attempt", "restart"):
            if payload.get(key) is not None:
                field_int(payload, key, "fault")
        for key in ("fault_ts", "detected_ts"):
            if payload.get(key) is not None:
                field_float(payload, key, "fault", low=0.0)
        return replace(Fault.from_json(payload), event_id=event["event_id"])
    except (TypeError, ValueError, OverflowError) as exc:
        log.warning("fault_record_unreadable", event_id=event["event_id"][:200],
                    error=repr(exc)[:200])
        return None


def ledger(events: Iterable[Mapping], prefix: str) -> Ledger:
    """Pure: the ledger of the faults under `prefix` from a run's `fault` and `recovered`
    events (storage/events.py read_events: well-formed events, one copy of each id)."""
    faults: dict[str, Fault] = {}
    closed: set[str] = set()
    for event in events:
        if event["kind"] == "recovered":
            closed |= closes(event)
        elif event["kind"] == "fault" and event["event_id"].startswith(prefix):
            fault = fault_of(event)
            if fault is not None:
                faults[event["event_id"]] = fault
    return Ledger(faults, frozenset(closed))


def last_launch(book: Ledger, prefix: str, attempt: int, beat_launch: int) -> int:
    """Pure: the newest launch of `attempt` the heartbeat or the log shows (module doc)."""
    seen = [beat_launch]
    for event_id in book.faults:
        k = launch_of(event_id, prefix, attempt)
        if k is not None:
            seen.append(k if book.is_open(event_id) else k + 1)
    return max(seen)


def answer(attempt: int, prefix: str, *, prior: Fault | None, decided: Fault | None,
           beat_launch: int = 0, book: Ledger | None = None) -> Answer:
    """Pure: what attempt `attempt` of the segment execution under `prefix` answers.

    `prior`: the fault in the previous attempt's last heartbeat; `decided`: the fault the
    workflow scheduled the segment after (a decision, a gang's blame); `beat_launch`: the
    previous attempt's launch its last heartbeat names; `book`: the log's ledger (None:
    the log could not be read, so nothing is known closed)."""
    known = book or Ledger()
    decided_open = decided is not None and bool(decided.event_id) \
        and known.is_open(decided.event_id)
    if attempt <= 1:  # the first attempt of an execution the workflow scheduled
        if not decided_open:
            return Answer()
        return Answer(decided.event_id, decided, decided.also)
    prev = attempt - 1
    launch = min(last_launch(known, prefix, prev, max(0, beat_launch)), MAX_RESTART)
    end_id = prefix + launch_tag(prev, launch)
    end = known.faults.get(end_id)
    if end is None and prior is not None and prior.event_id == end_id \
            and known.is_open(end_id):
        end = prior  # recorded, but its write failed: the heartbeat has it
    others = [i for i in sorted(known.faults) if known.is_open(i) and i != end_id]
    if decided_open and book is not None and decided.event_id not in (end_id, *others):
        others.append(decided.event_id)
    also = tuple(dict.fromkeys(a for a in (*(end.also if end else ()), *others)
                               if a != end_id and known.is_open(a)))
    return Answer(end_id, end, also, launch)
