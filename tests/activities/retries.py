"""A retried train_segment attempt's recovery, driven in Temporal's activity environment
against a real event log: shared by the tests of which fault a retry answers."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

from temporalio.testing import ActivityEnvironment

from activities.contracts import TrainSegmentInput
from activities.recovery import Recovery
from common.protocol import StartLine, StepLine
from storage.events import EventLog

INP = TrainSegmentInput(spec={}, dataset_uri="", from_step=0, to_step=40)


def retry_attempt(tmp_path, store: str, details: dict, scheduled: float, start: StartLine,
                  step: StepLine) -> Recovery:
    """Attempt 2, scheduled at `scheduled` with attempt 1's heartbeat `details`: settled, then
    fed its start line and its first step (its recovery)."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        env.info, attempt=2, heartbeat_details=[details],
        current_attempt_scheduled_time=datetime.fromtimestamp(scheduled, timezone.utc))
    workdir = tmp_path / "retry"
    workdir.mkdir()
    rec = env.run(lambda: Recovery(EventLog(store, "r1", "supervisor", attempt=2),
                                   str(workdir), INP, 2, "ex").settled())
    rec.on_progress(start)
    rec.on_progress(step)
    return rec
