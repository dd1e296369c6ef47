"""record_event: the local activity through which workflow decisions reach the event log."""

from __future__ import annotations

from temporalio import activity

from activities.contracts import RECORD_EVENT, RecordEventInput
from activities.errors import classified
from storage.events import EventLog


@activity.defn(name=RECORD_EVENT)
@classified
def record_event(inp: RecordEventInput) -> None:
    attempt = activity.info().attempt
    with EventLog(inp.durable, inp.run_id, "workflow", attempt=attempt) as events:
        events.record(inp.kind, inp.step, inp.event_id, inp.payload)
