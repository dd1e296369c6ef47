"""A train_segment attempt's heartbeat (DESIGN §3): what it says (DurableCommit: the last
committed checkpoint, when the beat was sent, the attempt's fault once recorded) and the
thread that sends it (Heartbeats), so neither a busy trainer nor a slow storage call can
delay it past the timeout."""

from __future__ import annotations

import threading
import time
from typing import Callable

from temporalio import activity

from common.protocol import CommitLine, ProgressLine
from common.threads import in_context

HEARTBEAT_EVERY_S = 1.0  # the heartbeat thread's beat (the worker sends at most one a
# second, ops/worker.py: a 5 s heartbeat timeout keeps 4 s of slack)


class DurableCommit:
    """The last committed checkpoint, as the child reports it: the heartbeat's content (and
    when it was sent, so a retry can tell when this attempt was last alive)."""

    def __init__(self, step: int | None, uri: str, repeat: dict | None = None) -> None:
        self.step, self.uri = step, uri
        self.fault: dict | None = None  # this attempt's fault, once recorded (recovery.py)
        self.repeat = repeat or {}  # the run of identical failures so far (recovery.py)

    def details(self) -> dict:
        beat = {"step": self.step, "uri": self.uri, "ts": round(time.time(), 3)}
        if self.repeat:
            beat["repeat"] = self.repeat
        return {**beat, "fault": self.fault} if self.fault else beat

    def on_progress(self, line: ProgressLine) -> None:
        if isinstance(line, CommitLine):
            self.step, self.uri = line.step, line.uri
            activity.heartbeat(self.details())

    def on_fault(self, details: dict) -> None:
        """The attempt's fault was recorded (activities/recovery.py): beat it now."""
        self.fault, self.repeat = details["fault"], details["repeat"]
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
