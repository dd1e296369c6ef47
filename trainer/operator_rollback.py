"""An operator's rollback (the workflow's `rollback` update), applied by the segment before
it trains: once per command id, recorded as a `rollback` event by the operator — or as
`rollback_refused` when retention removed the target after the command was admitted."""

from __future__ import annotations

import structlog

from common.protocol import OperatorRollback
from trainer.context import SegmentContext
from trainer.data import cursor_after
from trainer.spikes import merge_ranges
from trainer.state import TrainState

log = structlog.get_logger(__name__)


def pending(ctx: SegmentContext, rollback: OperatorRollback | None) -> OperatorRollback | None:
    """The operator rollback this segment must apply first: None when there is none, or when
    an earlier attempt of this segment applied it already (its event is in the log)."""
    if rollback is None:
        return None
    done = any(e["event_id"] == rollback.event_id
               for e in ctx.read_events(("rollback", "rollback_refused")))
    return None if done else rollback


def refuse(ctx: SegmentContext, rollback: OperatorRollback, oldest: int | None) -> None:
    """No checkpoint at or before the operator's target is left: nothing was deleted; say
    so once (a retry reads this event)."""
    record = {"by": "operator", "to_step": rollback.to_step, "oldest_step": oldest,
              "note": rollback.note, "who": rollback.who,
              "reason": f"no committed checkpoint at or before step {rollback.to_step} is "
                        f"left; the oldest is {oldest}"}
    log.warning("operator_rollback_refused", **record)
    if ctx.events is not None:
        ctx.events.emit("rollback_refused", step=rollback.through_step,
                        event_id=rollback.event_id, **record)
        ctx.events.flush()


def apply(ctx: SegmentContext, state: TrainState, rollback: OperatorRollback,
          discarded: list[int]) -> None:
    """After restoring the newest checkpoint at or before `to_step`: with `skip_data`, add
    the data the abandoned steps read (up to `through_step`) to the skip ranges, then record
    the decision (a `rollback` event by the operator, flushed so a retry does not redo it)."""
    through, window = rollback.through_step, None
    if rollback.skip_data and through > state.step:
        per_step = ctx.spec.train.grad_accum
        end = cursor_after(state.data_cursor, (through - state.step) * per_step,
                           state.skip_ranges)
        window = (state.data_cursor, end)
        state.skip_ranges = merge_ranges(list(state.skip_ranges) + [window])
    record = {"by": "operator", "at_step": through, "to_step": state.step,
              "skip": list(window) if window else None, "discarded": discarded,
              "lost_steps": max(0, through - state.step), "note": rollback.note,
              "who": rollback.who}
    log.warning("operator_rollback", **record)
    if ctx.events is not None:
        ctx.events.emit("rollback", step=through, event_id=rollback.event_id, **record)
        ctx.events.flush()
