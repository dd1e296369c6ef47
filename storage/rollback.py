"""Rollback without loss: choose and verify the restore target first, only then uncommit.

DESIGN §3: "A rollback (spike or operator) chooses and verifies its restore target *before*
it uncommits anything newer; a target that retention removed is refused." An earlier
version did the opposite: every step newer than the target was deleted on both tiers,
and only then was a checkpoint at or before the target looked for — with `keep_last=1` a
spike just after a commit deleted the only checkpoint, and an operator rollback to a step
retention had already removed wiped every newer one and restarted the run from step 0.

`roll_back` is the one procedure both rollbacks use (trainer/checkpoint_manager.py): `load`
restores a candidate into the live engine (and raises `CorruptCheckpoint` when a file
does not verify or refuses to load safely: the next older one is tried); only when one
has loaded are the newer checkpoints — the abandoned trajectory — uncommitted, newest
first, manifest first, so a rollback cut short at any point leaves the target and
everything older committed, and at worst some of the abandoned ones still there (the
replay then finds them committed, and the next rollback attempt removes them).

Lineages (`runs/<run_id>/lineage/<n>.json`, {"lineage", "restored_step", "abandoned"}):
a run's fast tier is shared by its segments on each machine, so a copy of the abandoned
trajectory could outlive a rollback on another machine — machine A kept step 700, B rolled
back to 500, uncommitted 600 and 700 and committed 600, and the retry on A resumed its
700, uploaded it as a durable commit, and its collector kept it as "newer than the
durable newest": the rollback and its skip ranges were silently undone. Now every
completed rollback starts a new lineage: its record is written, never overwritten
(`put_new`), *before* the uncommit, so the decision is durable first and anything the
uncommit leaves behind when cut short is recognised as abandoned by every reader. Each
manifest carries its lineage (`extra["lineage"]`, absent: 0, the run's first). A
checkpoint (step s, lineage L) is abandoned when some record n > L restored a step below
s (`abandoned`): the history from lineage n on is the record's restored prefix plus what
lineage n committed. A copy so abandoned is never resumed from nor uploaded
(storage/tiered.py, storage/tiered_writer.py) nor kept by a collector
(storage/fast_tier.py).

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
from dataclasses import dataclass
from typing import TypeVar

import structlog

from common.errors import StorageUnavailable
from common.store_json import StoreRecordInvalid, field_int, load_record
from storage.checkpoints import CheckpointManifest, CheckpointStore
from storage.fs import is_unavailable, join, put_new

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
              branch: Callable[[int, list[int]], object] | None = None,
              ) -> tuple[T | None, list[int]]:
    """Load the newest good checkpoint at or before `at_or_before`, then start a new lineage
    (`branch(restored step, the newer steps)`: TieredCheckpointer.branch records it on the
    durable tier), then uncommit the newer ones.

    `load(bound)` restores the newest verified checkpoint at or before `bound` and returns
    what it restored (None when there is none: then nothing is deleted nor recorded, and
    the caller refuses the rollback). Returns (restored, uncommitted steps).
    """
    restored = load(at_or_before)
    if restored is None:
        log.warning("rollback_refused", at_or_before=at_or_before,
                    committed=sorted({s for st in stores for s in st.list_committed()}))
        return None, []
    step = step_of(restored)
    if branch is not None:
        branch(step, sorted({s for st in stores for s in st.list_committed() if s > step}))
    return restored, uncommit_after(step, stores)


# ---- lineages ---------------------------------------------------------------------------
LINEAGE = "lineage"  # the key in a manifest's `extra`, and the records' directory


@dataclass(frozen=True, kw_only=True)
class Branch:
    """A rollback's record: lineage `lineage` continues from `restored_step`; every older
    lineage's checkpoint after that step is abandoned."""

    lineage: int
    restored_step: int
    abandoned: tuple[int, ...] = ()  # what the rollback found newer (for a reader's eyes)


def lineage_of(man: CheckpointManifest) -> int:
    """A manifest's lineage; 0 (the run's first) when it has none, e.g. written before
    lineages existed."""
    value = man.extra.get(LINEAGE, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def current_lineage(branches: Sequence[Branch]) -> int:
    return max((b.lineage for b in branches), default=0)


def abandoned(step: int, lineage: int, branches: Sequence[Branch]) -> bool:
    """Pure: a checkpoint of `step` in `lineage` lies on a trajectory a later rollback left."""
    return any(b.lineage > lineage and step > b.restored_step for b in branches)


def is_live(store: CheckpointStore, step: int, branches: Sequence[Branch]) -> bool:
    """`store` holds a readable commit of `step` on a lineage no rollback left (no record:
    every commit is; only then are manifests read)."""
    if not branches:
        return True
    man = store.committed_manifest(step)
    return man is not None and not abandoned(step, lineage_of(man), branches)


def drop_if_abandoned(store: CheckpointStore, step: int, branches: Sequence[Branch]) -> bool:
    """Delete `store`'s copy of `step` (fast or durable) if its lineage is abandoned —
    what a rollback elsewhere, or one cut short after its record, left; True if it was."""
    if not branches:
        return False
    man = store.committed_manifest(step)
    if man is None or not abandoned(step, lineage_of(man), branches):
        return False
    log.warning("checkpoint_abandoned_dropped", step=step, lineage=lineage_of(man),
                current=current_lineage(branches), uri=store.uri(step))
    store.delete(step)
    return True


def left_behind(durable: CheckpointStore, step: int, lineage: int) -> int | None:
    """Before a durable commit of (step, lineage): the run's current lineage if a rollback
    has left this one (the commit must not be made), else None — after uncommitting an
    abandoned durable commit of the same step, which would make this commit a no-op."""
    branches = read_branches(durable)
    if abandoned(step, lineage, branches):
        return current_lineage(branches)
    drop_if_abandoned(durable, step, branches)
    return None


def commit_unless_left_behind(durable: CheckpointStore, step: int, lineage: int,
                              commit: Callable[[], CheckpointManifest],
                              ) -> CheckpointManifest | int:
    """A durable commit of (step, lineage) no rollback elsewhere can race. The writer checks
    the lineage records before it uploads (`left_behind`, tiered_writer's `_abandoned`);
    this reads them again after the manifest's put-if-absent. A rollback puts its record
    (put-if-absent too) and only then lists what to uncommit; on a store that reads its own
    writes (S3, a file system) whichever of the two comes second sees the other's write: the
    rollback's listing finds this manifest, or this re-read finds its record and uncommits
    the step here. Returns the committed manifest, or the run's current lineage when a
    rollback has left `lineage` (nothing of it stays)."""
    man = commit()
    branches = read_branches(durable)
    if abandoned(step, lineage_of(man), branches):
        drop_if_abandoned(durable, step, branches)
        return current_lineage(branches)
    return man


def live_committed(store: CheckpointStore) -> list[int]:
    """The committed steps on a lineage no rollback left, for retention and the scrub: an
    abandoned commit is no fallback (a restore drops it), so it is neither counted as the
    newest nor kept as one; it is dropped here, as a resume would."""
    branches = read_branches(store)
    live, left = split_abandoned(store, store.list_committed(), branches)
    for step in reversed(left):
        drop_if_abandoned(store, step, branches)
    return live


def split_abandoned(store: CheckpointStore, steps: Sequence[int], branches: Sequence[Branch],
                    ) -> tuple[list[int], list[int]]:
    """(live, abandoned) of committed `steps`, by their manifests' lineages — the rule resume
    and the fast tier's collector apply, for retention and the scrub. Only a step above
    some rollback's restored step can be abandoned: only those manifests are read. An
    unreadable manifest is not judged here (the readers that load it skip it)."""
    if not branches:
        return list(steps), []
    floor = min(b.restored_step for b in branches)
    live, left = [], []
    for step in steps:
        man = store.committed_manifest(step) if step > floor else None
        (left if man is not None and abandoned(step, lineage_of(man), branches)
         else live).append(step)
    return live, left


def lineage_dir(store: CheckpointStore) -> str:
    """`runs/<run_id>/lineage`, beside the store's `checkpoints/`."""
    return join(store.root.rsplit("/", 1)[0], LINEAGE)


def read_branches(store: CheckpointStore) -> tuple[Branch, ...]:
    """Every rollback's record on the durable tier, by lineage; StorageUnavailable when it
    cannot be read (a reader must not guess that nothing was abandoned)."""
    fs, directory = store.fs, lineage_dir(store)
    fs.invalidate_cache()
    try:
        paths = fs.ls(directory, detail=False)
    except FileNotFoundError:
        return ()
    except Exception as exc:
        if is_unavailable(exc):
            raise StorageUnavailable(store.url, repr(exc)) from exc
        raise
    found = []
    for path in paths:
        try:
            found.append(branch_of(fs.cat_file(path), path))
        except FileNotFoundError:
            continue
        except ValueError as exc:  # only a hand-made file: put_new; StoreRecordInvalid
            log.warning("lineage_record_unreadable", path=path, error=str(exc)[:200])
        except Exception as exc:
            if is_unavailable(exc):
                raise StorageUnavailable(store.url, repr(exc)) from exc
            raise
    return tuple(sorted(found, key=lambda b: b.lineage))


def branch_of(raw: bytes, path: str) -> Branch:
    """A lineage record's Branch; StoreRecordInvalid when it is not one mainspring writes:
    its number must be its file's name (`<n>.json`), so one forged record cannot claim a
    lineage above every other and abandon the whole run."""
    record = load_record(raw, path)
    lineage = field_int(record, "lineage", path, low=1)
    named = path.rsplit("/", 1)[-1].removesuffix(".json")
    if not (named.isdigit() and int(named) == lineage):
        raise StoreRecordInvalid(f"{path}.lineage", f"{lineage} is not the file's number")
    listed = record.get("abandoned", [])
    if not isinstance(listed, list):
        raise StoreRecordInvalid(f"{path}.abandoned", "is not a list")
    return Branch(lineage=lineage, restored_step=field_int(record, "restored_step", path),
                  abandoned=tuple(field_int({"s": s}, "s", f"{path}.abandoned") for s in listed))


def start_lineage(store: CheckpointStore, restored_step: int, newer: Sequence[int]) -> int:
    """Record a rollback to `restored_step` as the next lineage; returns its number. Two
    writers racing for a number: the loser takes the next one (an extra record only
    repeats what the first says about older lineages)."""
    directory = lineage_dir(store)
    store.fs.makedirs(directory, exist_ok=True)
    number = 0
    while True:  # (never the same number twice: a file no reader parses still takes it)
        number = max(number, current_lineage(read_branches(store))) + 1
        record = {"lineage": number, "restored_step": int(restored_step),
                  "abandoned": sorted(int(s) for s in newer)}
        try:
            put_new(store.fs, join(directory, f"{number:09d}.json"), json.dumps(record).encode())
        except FileExistsError:
            continue
        except Exception as exc:
            if is_unavailable(exc):
                raise StorageUnavailable(store.url, repr(exc)) from exc
            raise
        log.info("lineage_started", lineage=number, restored_step=restored_step,
                 abandoned=record["abandoned"])
        return number



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
            steps.add(field_int(load_record(fs.cat_file(path), path), "to_step", path))
        except (ValueError, FileNotFoundError) as exc:  # ValueError: StoreRecordInvalid
            log.warning("rollback_pin_unreadable", path=path, error=str(exc)[:200])
    return frozenset(steps)
