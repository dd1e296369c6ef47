"""A train_segment attempt's heartbeat (DESIGN §3): what it says (DurableCommit: the last
committed checkpoint, when the beat was sent, the attempt's fault once recorded) and the
thread that sends it (Heartbeats), so neither a busy trainer nor a slow storage call can
delay it past the timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from temporalio import activity

from common.faults import Fault, Repeat
from common.protocol import CommitLine, ProgressLine
from common.threads import in_context

HEARTBEAT_EVERY_S = 1.0  # the heartbeat thread's beat (the worker sends at most one a
# second, ops/worker.py: a 5 s heartbeat timeout keeps 4 s of slack)


@dataclass(frozen=True)
class Beat:
    """One heartbeat's details, as the next attempt reads them: the last committed step and
    its uri, when the beat was sent, the fault the attempt's running launch ended with once
    recorded, the run of identical failures so far, and which launch of the attempt runs
    (`restart`: k for its k-th restart in place). A restart in place takes the fault out:
    its own recovery closes it, so a retry after a later loss cannot name it again
    (activities/fault_ledger.py). On the wire one JSON object (`to_json` /
    `from_details`)."""

    step: int | None = None
    uri: str = ""
    ts: float | None = None
    fault: Fault | None = None
    repeat: Repeat = Repeat()
    restart: int = 0

    def to_json(self) -> dict[str, Any]:
        beat: dict[str, Any] = {"step": self.step, "uri": self.uri, "ts": self.ts}
        if self.repeat.fingerprint:
            beat["repeat"] = self.repeat.to_json()
        if self.restart:
            beat["restart"] = self.restart
        return {**beat, "fault": self.fault.to_json()} if self.fault else beat

    @classmethod
    def from_details(cls, details: Sequence[Any] | None) -> Beat:
        """The last attempt's heartbeat (activity.info().heartbeat_details); empty: none."""
        raw = details[0] if details and isinstance(details[0], Mapping) else {}
        fault, restart = raw.get("fault"), raw.get("restart")
        return cls(step=raw.get("step"), uri=str(raw.get("uri") or ""), ts=raw.get("ts"),
                   fault=Fault.from_json(fault) if isinstance(fault, Mapping) else None,
                   repeat=Repeat.from_json(raw.get("repeat")),
                   restart=restart if isinstance(restart, int) and not isinstance(
                       restart, bool) and 0 <= restart <= 10_000 else 0)


class DurableCommit:
    """The last committed checkpoint, as the child reports it: the heartbeat's content (and
    when it was sent, so a retry can tell when this attempt was last alive)."""

    def __init__(self, step: int | None, uri: str, repeat: Repeat | None = None) -> None:
        self.step, self.uri = step, uri
        self.fault: Fault | None = None  # the running launch's fault, once recorded
        self.repeat = repeat or Repeat()  # the run of identical failures so far (recovery.py)
        self.restart = 0  # which launch of the attempt runs (activities/launch.py)

    def details(self) -> dict[str, Any]:
        return Beat(self.step, self.uri, round(time.time(), 3), self.fault,
                    self.repeat, self.restart).to_json()

    def on_progress(self, line: ProgressLine) -> None:
        if isinstance(line, CommitLine):
            self.step, self.uri = line.step, line.uri
            activity.heartbeat(self.details())

    def on_fault(self, fault: Fault, repeat: Repeat) -> None:
        """The attempt's fault was recorded (activities/recovery.py): beat it now."""
        self.fault, self.repeat = fault, repeat
        activity.heartbeat(self.details())

    def on_restart(self, restart: int) -> None:
        """The attempt launches again in place: the fault is its restart's to close, so it
        leaves the heartbeat, which names the new launch instead; beat it now."""
        self.fault, self.restart = None, restart
        activity.heartbeat(self.details())


class Heartbeats:
    """The activity's heartbeat from a thread of its own, every `every_s`: neither a busy
    trainer nor a slow storage call in the supervisor's loop can delay it past the timeout.
    It stops beating when the supervisor shows no life for `stall_s` (a stuck supervisor
    is a lost worker)."""

    def __init__(self, details: Callable[[], dict], every_s: float,
                 stall_s: float = 300.0) -> None:
        self.details, self.every_s, self.stall_s = details, every_s, stall_s
        self.alive = time.monotonic()
        self.stop = threading.Event()

    def tick(self) -> None:
        """The supervisor is alive (and beats now)."""
        self.alive = time.monotonic()
        activity.heartbeat(self.details())

    def __enter__(self) -> Heartbeats:
        in_context(self._run, name="mainspring-heartbeat")
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            if time.monotonic() - self.alive < self.stall_s:
                activity.heartbeat(self.details())
