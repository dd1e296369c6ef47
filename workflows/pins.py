"""Pins for admitted operator rollbacks (storage/rollback.py), from workflow code.

The `rollback` update pins its target before the command is queued; the pin is released
once a segment has applied the rollback (or at once when it turned out moot). Retention,
which runs after every commit while the running segment stops, keeps the newest commit at
or before every pinned step — so a rollback admitted against the oldest checkpoint left is
never refused because the stop's own commits retired that checkpoint.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.contracts import PIN_ROLLBACK, PinInput
    from spec import RunSpec


async def pin_targets(spec: RunSpec, pin_ids: list[str], to_step: int | None) -> None:
    """Pin `to_step` under each id, or (to_step None) release the pins."""
    await workflow.execute_local_activity(
        PIN_ROLLBACK, PinInput(durable=spec.storage.durable, run_id=spec.run_id,
                               pin_ids=list(pin_ids), to_step=to_step),
        start_to_close_timeout=timedelta(seconds=60),
        summary=(f"pin rollback target step {to_step} against retention" if to_step is not None
                 else f"release {len(pin_ids)} rollback pin(s)"))
