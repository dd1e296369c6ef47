"""One fault, one record, from detection to decision (docs/faults.md, "Life of a fault").

`Fault` is what a detector saw (the supervisor, the next attempt, the server watch, the
workflow's gang blame), created where it is seen and carried unchanged: into the run's
event log (`record_fault`, the one writer of `fault` events; `fault_event` for workflow
code, which records through an activity), into the attempt's heartbeat details, into the
ApplicationError details of a failure the workflow decides on, and into the run's carry
(`after_fault`: the fault the next segment's `recovered` answers). Across each of those
boundaries it is one JSON object, `to_json` / `from_json`, whose keys are the `fault`
event payload's (readers of the log keep working: keys were added, none renamed).

A fault has an identity (`event_id`), and the `recovered` that answers it has the id
derived from it (`recovered_id`): two closers of one fault (a Temporal outage longer than
the heartbeat timeout is closed by the server watch when the server answers and by the
retried attempt at its first step) write one event id, so a reader keeps the first copy
only (storage/events.py: the earliest copy of an id wins), and a closer that finds it
already written writes nothing: one `recovered`, one MTTR.

Stdlib only: the workflow sandbox imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

from common.fault_kinds import TRANSIENT_KINDS

# who saw it (the `detected_by` of a fault event)
SUPERVISOR, NEXT_ATTEMPT, SERVER_WATCH, WORKFLOW = (
    "supervisor", "next_attempt", "server_watch", "workflow")


@dataclass(frozen=True)
class Fault:
    """One fault: its kind (common/fault_kinds.py) and evidence, where it struck (rank, node,
    segment, attempt and restart, the last step seen), when it happened (`fault_ts`, the
    last sign of life) and when it was seen (`detected_ts`), by whom, and the facts of its
    kind (`facts`: a hang's timeout, a lost worker's heartbeat, the server's address; they
    sit beside the other keys in the event payload)."""

    kind: str
    evidence: str = ""
    event_id: str = ""
    injected: bool = False
    detected_by: str = ""
    fault_ts: float | None = None
    detected_ts: float | None = None
    attempt: int | None = None
    restart: int = 0
    segment: str = ""
    last_step: int | None = None
    rank: int | None = None
    node: str = ""
    exit_code: int | None = None
    signal: str | None = None
    error_type: str = ""
    frame: str = ""  # where the exception was raised (error.json), for the repeat signature
    log_tail: tuple[str, ...] = ()
    fingerprint: str = ""  # what makes two failures "the same" (activities/recovery.py)
    repeats: int = 0  # that failure's run in a row, this one included
    peer: bool = False  # failed by losing a peer (workflows/gang.py), not of its own
    also: tuple[str, ...] = ()  # the other faults answered with it (a gang's peers')
    facts: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # to the millisecond, as the event log keeps them: the same record on both sides
        for name in ("fault_ts", "detected_ts"):
            object.__setattr__(self, name, to_ms(getattr(self, name)))

    @property
    def transient(self) -> bool:
        """A kind whose cause is outside the run: it never counts towards the repeat budget."""
        return self.kind in TRANSIENT_KINDS

    @property
    def detection_s(self) -> float | None:
        return detection_between(self.fault_ts, self.detected_ts)

    def to_json(self) -> dict[str, Any]:
        """The one JSON shape of a fault: the event payload, the heartbeat's and the
        failure details' `fault`, the carry's `after_fault`. Empty optional fields are
        left out but for those older readers expect."""
        out: dict[str, Any] = {**self.facts}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "facts" or (f.name in _OMITTED_EMPTY and not value):
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["detection_s"] = self.detection_s
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Fault:
        """The record from its JSON object; an older, smaller one (a heartbeat's or a
        carry's {event_id, fault_ts, detected_ts, last_step}) reads too, and keys that are
        no field (and not derived) are the kind's facts."""
        known = {f.name for f in dataclasses.fields(cls)} - {"facts"}
        values = {k: v for k, v in raw.items() if k in known}
        for name in ("log_tail", "also"):
            values[name] = tuple(str(x) for x in values.get(name) or ())
        facts = {k: v for k, v in raw.items() if k not in known and k not in _DERIVED}
        return cls(**{"kind": "", **values}, facts=facts)

    @classmethod
    def from_error_details(cls, details: Sequence[Any], *, error_type: str = "",
                           message: str = "") -> Fault:
        """The fault a failure's ApplicationError details carry (activities/errors.py puts
        it under `fault`). Failures raised by older code carry only the error's own flat
        fields (OutOfMemory, RepeatedFailure, NodeFailed): read from those, as it was;
        none at all: a fault of the error's type, its message the evidence."""
        first = details[0] if details and isinstance(details[0], Mapping) else {}
        if isinstance(first.get("fault"), Mapping):
            return cls.from_json(first["fault"])
        fault_ts = first.get("fault_ts")
        return cls(kind=str(first.get("fault_kind") or error_type or "crash"),
                   evidence=str(first.get("evidence") or message)[:500],
                   event_id=str(first.get("fault_event_id") or ""), fault_ts=fault_ts,
                   # a child's exit is seen at once (activities/supervise.py)
                   detected_ts=first.get("detected_ts", fault_ts),
                   last_step=first.get("last_step"), node=str(first.get("node") or ""),
                   fingerprint=str(first.get("fingerprint") or ""),
                   repeats=int(first.get("repeats") or 0), peer=bool(first.get("peer")))

    def answering(self, *others: str) -> Fault:
        """This fault, with `others` (fault ids) answered by the same recovery."""
        return dataclasses.replace(self, also=tuple(others))


@overload
def to_ms(ts: float) -> float: ...
@overload
def to_ms(ts: None) -> None: ...
def to_ms(ts: float | None) -> float | None:
    """A time as the event log keeps it: to the millisecond."""
    return None if ts is None else round(ts, 3)


def detection_between(fault_ts: float | None, detected_ts: float | None) -> float | None:
    """Pure: seconds from a fault to its detection, of the two times as the log keeps
    them, so the fault event and its `recovered` event say the same number."""
    a, b = to_ms(fault_ts), to_ms(detected_ts)
    return None if a is None or b is None else round(max(0.0, b - a), 3)


# left out of the JSON when empty (no older reader looks for them); the rest always there
_OMITTED_EMPTY = frozenset({"restart", "node", "fingerprint", "repeats", "peer", "also"})
_DERIVED = frozenset({"detection_s"})


class EventSink(Protocol):
    """What `record_fault` writes to: storage/events.py's EventLog."""

    def emit(self, kind: str, payload: Mapping[str, Any] | None = None, /, *,
             step: int | None = None, event_id: str | None = None,
             **fields: Any) -> dict[str, Any]: ...


def fault_event(fault: Fault) -> tuple[str, str, dict[str, Any]]:
    """Pure: the `fault` event of a fault — (kind, event id, payload). Workflow code records
    it through its record_event activity; everything else through `record_fault`."""
    return "fault", fault.event_id, fault.to_json()


def record_fault(events: EventSink, fault: Fault) -> None:
    """The one writer of `fault` events: buffered in `events` at the fault's last step
    (the caller flushes: when, and what a failed flush means, is the detector's)."""
    kind, event_id, payload = fault_event(fault)
    events.emit(kind, payload, step=fault.last_step, event_id=event_id or None)


def recovered_id(fault_event_id: str) -> str:
    """Pure: the id of the one `recovered` event a fault can have."""
    return f"recovered/{fault_event_id}"


@dataclass(frozen=True)
class Repeat:
    """The run of identical failures so far (ops.repeat_failure_limit): the fingerprint they
    share and how many in a row. Carried from attempt to attempt in the heartbeat."""

    fingerprint: str = ""
    repeats: int = 0

    def after(self, fault: Fault) -> Repeat:
        """Pure: the run after `fault` (its fingerprint set). A transient kind (the worker
        lost, storage away, a preemption) neither counts nor breaks it."""
        if fault.transient:
            return self
        if fault.fingerprint == self.fingerprint:
            return Repeat(self.fingerprint, self.repeats + 1)
        return Repeat(fault.fingerprint, 1)

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "repeats": self.repeats} if self.fingerprint \
            else {}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> Repeat:
        raw = raw or {}
        return cls(str(raw.get("fingerprint") or ""), int(raw.get("repeats") or 0))
