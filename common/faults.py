"""A fault's identity and the one `recovered` that closes it (docs/faults.md, "Life of a
fault").

A fault event has a stable id (activities/recovery.py `fault_id`, the server watch's per
outage, storage's per step). The `recovered` that answers it has the id derived from it:
two closers of one fault (a Temporal outage longer than the heartbeat timeout is closed by
the server watch when the server answers and by the retried attempt at its first step)
write one event id, so a reader keeps the first copy only (storage/events.py: the earliest
copy of an id wins), and a closer that finds it already written writes nothing.
"""

from __future__ import annotations


def recovered_id(fault_event_id: str) -> str:
    """Pure: the id of the one `recovered` event a fault can have."""
    return f"recovered/{fault_event_id}"
