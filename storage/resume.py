"""Which checkpoint a resume restores: the newest one that verifies on either tier and whose
lineage no rollback has left (storage/rollback.py). Used by TieredCheckpointer.resume
(storage/tiered.py), which then queues `Choice.upload` for its writer; kept apart so the
choice runs without a writer process (tests/storage/test_rollback_safety.py drives it on
two machines' fast tiers).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from storage.checkpoints import CheckpointManifest, CheckpointStore, CorruptCheckpoint, step_dir
from storage.rollback import (
    Branch,
    abandoned,
    current_lineage,
    drop_if_abandoned,
    lineage_of,
    read_branches,
)

log = structlog.get_logger(__name__)

OnCorrupt = Callable[[CorruptCheckpoint], None]


@dataclass(frozen=True, kw_only=True)
class Choice:
    found: tuple[CheckpointManifest, str, str] | None  # (manifest, load root, tier)
    upload: tuple[int, ...] = ()  # fast-only steps to upload so the durable tier catches up
    lineage: int = 0  # the run's current lineage: what snapshots carry from here on


def choose(fast: CheckpointStore | None, durable: CheckpointStore, local_root: str,
           at_or_before: int | None, on_corrupt: OnCorrupt | None = None) -> Choice:
    """The newest checkpoint at or before `at_or_before` that verifies on either tier.

    A fast-tier copy is verified by hashing it in place and loads from `fast.root`; a
    durable one is fetched (verified while copying) into `local_root/step-…`. A corrupt
    copy is reported and skipped (a corrupt fast copy is deleted). A copy of an abandoned
    lineage is never picked: a fast one is deleted, a durable one uncommitted (what a
    rollback cut short after its record left). `fast=None` picks from the durable tier only.
    """
    def wanted(steps: list[int]) -> list[int]:
        return [s for s in steps if at_or_before is None or s <= at_or_before]

    branches = read_branches(durable)
    lineage = current_lineage(branches)
    local = wanted(fast.list_committed()) if fast is not None else []
    committed = wanted(durable.list_committed())
    for step in sorted(set(local) | set(committed), reverse=True):
        if step in local:
            problems = fast.verify(step)
            if not problems and not drop_if_abandoned(fast, step, branches):
                newest = committed[-1] if committed else -1
                upload = [s for s in local if newest < s <= step and s not in committed]
                return Choice(found=(fast.manifest(step), fast.root, "fast"), lineage=lineage,
                              upload=tuple(kept_for_upload(fast, upload, branches)))
            if problems:
                _tell(problems[0], on_corrupt)
                fast.delete(step)
        if step in committed and drop_if_abandoned(durable, step, branches):
            committed.remove(step)
        elif step in committed:
            try:
                man = durable.fetch(step, os.path.join(local_root, step_dir(step)))
                return Choice(found=(man, local_root, "durable"), lineage=lineage)
            except CorruptCheckpoint as exc:
                _tell(exc, on_corrupt)
    return Choice(found=None, lineage=lineage)


def kept_for_upload(fast: CheckpointStore, steps: list[int], branches: tuple[Branch, ...],
                    ) -> list[int]:
    """The fast-only `steps` worth uploading: a corrupt one is skipped (not the resume), an
    abandoned one deleted."""
    kept = []
    for step in steps:
        try:
            man = fast.manifest(step)
        except CorruptCheckpoint as exc:
            _tell(exc, None)
            continue
        if abandoned(step, lineage_of(man), branches):
            fast.delete(step)
            continue
        kept.append(step)
    return kept


def _tell(exc: CorruptCheckpoint, on_corrupt: OnCorrupt | None) -> None:
    log.warning("checkpoint_corrupt", step=exc.step, file=exc.file, expected=exc.expected,
                actual=exc.actual)
    if on_corrupt:
        on_corrupt(exc)
