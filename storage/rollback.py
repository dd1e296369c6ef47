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

Pins (`runs/<run_id>/pins/<id>.json`, {"to_step"}): an operator rollback admitted by the
workflow pins its target before it is queued, and retention keeps the newest commit at or
before every pinned step (storage/retention.py) until the workflow releases the pin, once a
segment has applied the rollback — so the commits made while the running segment stops
cannot retire the checkpoint the rollback was admitted against (DESIGN §3: retention never
removes anything a pending rollback may need).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TypeVar

import structlog

from storage.checkpoints import CheckpointStore
from storage.fs import join, put_new

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



def pins_dir(store: CheckpointStore) -> str:
    """`runs/<run_id>/pins`, beside the store's `checkpoints/`."""
    return join(store.root.rsplit("/", 1)[0], "pins")


def pin(durable_url: str, run_id: str, pin_id: str, to_step: int) -> None:
    """Protect the newest commit at or before `to_step` from retention (idempotent)."""
    store = CheckpointStore(durable_url, run_id)
    path = join(pins_dir(store), f"{pin_id}.json")
    store.fs.makedirs(pins_dir(store), exist_ok=True)
    try:
        put_new(store.fs, path, json.dumps({"to_step": int(to_step)}).encode())
    except FileExistsError:
        pass  # a retry of the local activity
    log.info("rollback_target_pinned", pin=pin_id, to_step=to_step)


def unpin(durable_url: str, run_id: str, pin_ids: Sequence[str]) -> None:
    store = CheckpointStore(durable_url, run_id)
    for pin_id in pin_ids:
        path = join(pins_dir(store), f"{pin_id}.json")
        if store.fs.exists(path):
            store.fs.rm_file(path)
    log.info("rollback_targets_released", pins=list(pin_ids))


def pinned_steps(store: CheckpointStore) -> frozenset[int]:
    """The targets of the rollbacks admitted and not yet applied (unreadable pins count as
    nothing: a pin only ever keeps more)."""
    fs, directory = store.fs, pins_dir(store)
    fs.invalidate_cache()
    if not fs.exists(directory):
        return frozenset()
    steps = set()
    for path in fs.ls(directory, detail=False):
        try:
            steps.add(int(json.loads(fs.cat_file(path))["to_step"]))
        except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
            log.warning("rollback_pin_unreadable", path=path, error=repr(exc)[:200])
    return frozenset(steps)
