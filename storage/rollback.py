"""Rollback without loss: choose and verify the restore target first, only then uncommit.

DESIGN §3: "A rollback (spike or operator) chooses and verifies its restore target *before*
it uncommits anything newer; a target that retention removed is refused." Issue 11 found
the opposite order on main: every step newer than the target was deleted on both tiers,
and only then was a checkpoint at or before the target looked for — with `keep_last=1` a
spike just after a commit deleted the only checkpoint, and an operator rollback to a step
retention had already removed wiped every newer one and restarted the run from step 0.

`roll_back` is the one procedure both rollbacks use (trainer/checkpointing.py): `load`
restores a candidate into the live engine (and raises `CorruptCheckpoint` when a file
does not verify or refuses to load safely: the next older one is tried); only when one
has loaded are the newer checkpoints — the abandoned trajectory — uncommitted, newest
first, manifest first, so a rollback cut short at any point leaves the target and
everything older committed, and at worst some of the abandoned ones still there (the
replay then finds them committed, and the next rollback attempt removes them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import structlog

from storage.checkpoints import CheckpointStore

log = structlog.get_logger(__name__)

T = TypeVar("T")


def uncommit_after(step: int, stores: Sequence[CheckpointStore]) -> list[int]:
    """Delete every checkpoint newer than `step` on each store, newest first (a deletion
    cut short never leaves a hole below a surviving newer checkpoint). Returns the steps."""
    gone = sorted({s for store in stores for s in store.list_committed() if s > step})
    for s in reversed(gone):
        for store in stores:
            store.delete(s)
    return gone


def roll_back(at_or_before: int, load: Callable[[int | None], T | None],
              step_of: Callable[[T], int], stores: Sequence[CheckpointStore],
              ) -> tuple[T | None, list[int]]:
    """Load the newest good checkpoint at or before `at_or_before`, then uncommit newer ones.

    `load(bound)` restores the newest verified checkpoint at or before `bound` and returns
    what it restored (None when there is none: then nothing is deleted, and the caller
    refuses the rollback). Returns (restored, uncommitted steps).
    """
    restored = load(at_or_before)
    if restored is None:
        log.warning("rollback_refused", at_or_before=at_or_before,
                    committed=sorted({s for st in stores for s in st.list_committed()}))
        return None, []
    return restored, uncommit_after(step_of(restored), stores)

