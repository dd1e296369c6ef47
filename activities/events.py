"""record_event: the local activity through which workflow decisions reach the event log;
pin_rollback: the one through which an admitted operator rollback pins its target."""

from __future__ import annotations

from temporalio import activity

from activities.contracts import PIN_ROLLBACK, RECORD_EVENT, PinInput, RecordEventInput
from activities.errors import classified
from common.telemetry import bind_run
from storage.events import EventLog
from storage.rollback import pin, unpin


@activity.defn(name=RECORD_EVENT)
@classified
def record_event(inp: RecordEventInput) -> None:
    attempt = activity.info().attempt
    bind_run(inp.durable, inp.run_id)  # the workflow's spans of this trace go to the run
    with EventLog(inp.durable, inp.run_id, "workflow", attempt=attempt) as events:
        events.emit(inp.kind, inp.payload, step=inp.step, event_id=inp.event_id)


@activity.defn(name=PIN_ROLLBACK)
@classified
def pin_rollback(inp: PinInput) -> None:
    if inp.to_step is None:
        unpin(inp.durable, inp.run_id, inp.pin_ids)
    else:
        for pin_id in inp.pin_ids:
            pin(inp.durable, inp.run_id, pin_id, inp.to_step)
