"""The fast tier on a trainer machine's local disk: one checkpoint store per run, bounded.

Layout under `storage.fast`: `<run_id>/ckpt/step-…/` (the run's fast-tier store, shared
by all its segments on this machine, so the writer's cleanup — keep the newest durable
copy and what is still uploading — spans segments), `<run_id>/segments/<lo>-<hi>/` (each
segment's progress file, logs, result), `<run_id>/cache/` (verified copies of the dataset's shards and the event log's batches, so
a restart here does not fetch them again), `<run_id>/fast.json` (which durable store the run
commits to), `<run_id>/.lease` (held with flock while an activity of the run uses it) and
`<run_id>/.made-by-mainspring` (the creation mark `lease` puts in a directory it makes).

Once each segment had its own store and nothing removed a finished segment's
checkpoints, so the local disk filled linearly with segments. Now:
- a run's fast store is one directory, cleaned after every durable commit;
- before an activity uses the fast tier, `collect_garbage` visits the other runs on this
  machine that no activity holds: a fast copy that is committed on the durable tier is
  only a cache and goes; a fast-only snapshot newer than the durable tier's newest (its
  upload never finished) is the only copy of that progress and stays — unless a rollback
  recorded on the durable tier left its lineage (storage/rollback.py); a run directory
  left with no checkpoint is removed whole (finished runs end up here);
- `release` removes a finished run's checkpoints on the machine that evaluates it; the
  run's segment records go with the next collection there.
The fast tier never holds the only copy of anything this deletes.

What the collector may delete, it proves it made, and it deletes only while holding the
run's lease (flock, non-blocking: a held run is skipped). `storage.fast` overlapping
`storage.durable` was accepted, and the collector removed `<fast>/<name>` whole: with
`fast = <durable>/runs` that was another run's durable checkpoints, with `fast == durable`
and a run named `runs` every run's. Now overlapping tiers are refused (the spec's paths,
then the worker's real paths: `check_tiers_apart`), the collector visits only directories
with the creation mark and removes only what activities put there (OWN_DIRS, OWN_FILES),
and it checked the lease and then deleted without it — an activity that leased the
directory in between lost its files, and a second lease of the run was granted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Iterator

import structlog

from common import urls
from common.errors import DiskFull, StorageUnavailable
from storage.checkpoints import CheckpointStore
from storage.fs import normalize_url
from storage.rollback import Branch, is_live, read_branches

log = structlog.get_logger(__name__)

RUN_FILE = "fast.json"
LEASE_FILE = ".lease"
MARK_FILE = ".made-by-mainspring"  # written by lease() into a directory it creates, only
OWN_DIRS = ("ckpt", "segments", "cache", "eval")  # what activities put in a run's directory
OWN_FILES = (RUN_FILE, LEASE_FILE, MARK_FILE)
# The leftovers of a worker killed mid-way: `.gc-<run>-<hex>` (a run directory the collector
# renamed aside and was emptying: checkpoints, dataset cache and all) and `.new-<run>-<hex>`
# (a run directory `lease` was making). Nothing else removes them, and the disk fills. Every
# collection sweeps those older than STALE_S whose lease nobody holds: a live collector
# holds the lease inside its `.gc-` directory (flock; the kernel drops it when the holder
# dies), and a live `lease` renames its `.new-` directory into place within milliseconds.
# An hour is far beyond either, and short against a disk filling over days.
LEFTOVERS = (".gc-", ".new-")
STALE_S = 3600.0


def run_dir(fast_root: str, run_id: str) -> str:
    return os.path.join(os.path.abspath(fast_root), run_id)


def store_dir(fast_root: str, run_id: str) -> str:
    """The run's fast-tier checkpoint store (`trainer.segment --fast-dir`)."""
    return os.path.join(run_dir(fast_root, run_id), "ckpt")


def cache_dir(fast_root: str, run_id: str) -> str:
    """Local copies of what a restart would otherwise fetch from the durable tier again
    (`trainer.segment --cache-dir`): `dataset/` (verified shards by sha256, storage/dataset.py
    read_array) and `events/` (the event log's immutable batches, storage/events.py
    read_events). They go with the run's directory."""
    return os.path.join(run_dir(fast_root, run_id), "cache")


def fast_steps_to_delete(fast: list[int], durable: list[int],
                         left: frozenset[int] = frozenset()) -> list[int]:
    """Pure: the fast copies another run no longer needs here — those committed durably,
    fast-only ones at or below the durable newest (a resume never picks them over it), and
    those of a lineage a rollback left (`left`: never resumed from, storage/rollback.py).
    Other fast-only snapshots newer than every durable commit are kept."""
    newest = max(durable, default=None)
    return sorted(s for s in fast if s in set(durable) or s in left
                  or (newest is not None and s <= newest))


def check_tiers_apart(fast_root: str, durable_url: str) -> None:
    """BadConfig naming `storage.fast` when the fast tier and a local durable tier overlap
    once symlinks are resolved (the spec checks the paths as written, common/urls.py): the
    collector below would otherwise visit the durable store's directories."""
    local = urls.tier_path(normalize_url(durable_url))
    if local is not None:  # (s3:// and memory:// are never on this disk)
        urls.check_tiers_apart(os.path.realpath(local), os.path.realpath(fast_root))


@contextlib.contextmanager
def lease(fast_root: str, run_id: str, durable_url: str) -> Iterator[str]:
    """Hold the run's directory for the length of an activity (garbage collection skips it);
    records the durable URL so a later collection can tell what is safe to delete."""
    check_tiers_apart(fast_root, durable_url)
    directory = run_dir(fast_root, run_id)
    while True:
        _create_run_dir(directory, run_id)
        held = open(os.path.join(directory, LEASE_FILE), "a+")
        fcntl.flock(held, fcntl.LOCK_EX)  # one activity per run per machine at a time
        if _still_there(held, directory):
            break
        held.close()  # a collector removed the directory while we waited: make it again
    try:
        _write_run_file(directory, run_id, durable_url)
        yield directory
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
        held.close()


def _create_run_dir(directory: str, run_id: str) -> None:
    """Make the run's directory with the collector's creation mark already inside (built
    under a temporary name, then renamed into place): a directory that carries the mark was
    made here, whole. One that exists already is used as it is — marked or not."""
    if os.path.isdir(directory):
        return
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".new-{run_id}-", dir=parent)
    with open(os.path.join(tmp, MARK_FILE), "w") as f:
        json.dump({"run_id": run_id}, f)
    try:
        os.rename(tmp, directory)
    except OSError:  # another activity of the run made it first
        os.unlink(os.path.join(tmp, MARK_FILE))
        os.rmdir(tmp)


def _still_there(held, directory: str) -> bool:
    """The lease file we locked is the one at its path (a collector that removed the
    directory meanwhile left us holding a file nobody else will open)."""
    try:
        return os.stat(os.path.join(directory, LEASE_FILE)).st_ino == os.fstat(held.fileno()).st_ino
    except FileNotFoundError:
        return False


def _write_run_file(directory: str, run_id: str, durable_url: str) -> None:
    tmp = os.path.join(directory, f".{RUN_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"run_id": run_id, "durable": durable_url}, f)
    os.replace(tmp, os.path.join(directory, RUN_FILE))


def made_here(directory: str, run_id: str) -> bool:
    """The directory carries the creation mark of `run_id`'s lease (see _create_run_dir)."""
    try:
        with open(os.path.join(directory, MARK_FILE)) as f:
            return json.load(f).get("run_id") == run_id
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def _try_hold(directory: str) -> Iterator[bool]:
    """The run's lease, if nobody holds it (never waits): True while held."""
    try:
        held = open(os.path.join(directory, LEASE_FILE), "a+")
    except OSError:
        yield False
        return
    with held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield _still_there(held, directory)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def collect_garbage(fast_root: str, keep_run: str, *, stale_s: float = STALE_S) -> list[str]:
    """Free what other runs left on this machine's fast tier; returns what was removed.
    Only directories this module made (their creation mark) are visited, each while holding
    its run's lease, so no activity of that run can start in between. A run whose durable
    store cannot be reached now is left for a later collection. Leftovers of a collector
    or a lease killed mid-way are swept first (`sweep_leftovers`)."""
    root = os.path.abspath(fast_root)
    if not os.path.isdir(root):
        return []
    removed = sweep_leftovers(root, stale_s=stale_s)
    for name in sorted(os.listdir(root)):
        directory = os.path.join(root, name)
        if name == keep_run or name.startswith(".") or not made_here(directory, name) \
                or not os.path.isfile(os.path.join(directory, RUN_FILE)):
            continue
        with _try_hold(directory) as held:
            if not held:
                continue
            try:
                removed += _collect_run(directory)
            except Exception as exc:  # best effort: a cache cleanup never fails the activity
                log.warning("fast_tier_gc_skipped", run_dir=directory, error=repr(exc)[:300])
    if removed:
        log.info("fast_tier_gc", removed=removed)
    return removed


def _collect_run(directory: str) -> list[str]:
    """(Holding the run's lease.)"""
    with open(os.path.join(directory, RUN_FILE)) as f:
        info = json.load(f)
    fast = CheckpointStore.local(os.path.join(directory, "ckpt"))
    store = CheckpointStore(info["durable"], info["run_id"])
    try:
        durable, branches = store.list_committed(), read_branches(store)
    except StorageUnavailable:
        return []
    steps = fast.list_committed()
    doomed = fast_steps_to_delete(steps, _live_durable(store, durable, steps, branches),
                                  frozenset(s for s in steps if not is_live(fast, s, branches)))
    for step in doomed:
        fast.delete(step)
    if len(doomed) == len(steps):  # nothing here is the only copy of anything
        return [directory] if _remove_own(directory) else []
    return [fast.path(s) for s in doomed]


def _live_durable(store: CheckpointStore, durable: list[int], fast: list[int],
                  branches: tuple[Branch, ...]) -> list[int]:
    """What fast_steps_to_delete needs of the durable steps, without an abandoned commit a
    rollback cut short left (its step is not a durable copy of anything, nor the newest):
    those the fast tier holds too, and the newest live one. Few manifests are read."""
    held = [s for s in durable if s in set(fast) and is_live(store, s, branches)]
    newest = next((s for s in reversed(durable) if is_live(store, s, branches)), None)
    return sorted(set(held) | ({newest} if newest is not None else set()))


def _remove_own(directory: str) -> bool:
    """(Holding the run's lease.) Remove what the fast tier puts in a run's directory
    (OWN_DIRS, OWN_FILES), then the directory; when anything else is in it, all of that
    stays, and so do the directory and its mark (a later collection tries again). The
    directory is renamed aside first, so an activity that waits for this lease finds no
    directory and makes a fresh one (lease: _still_there)."""
    tomb = os.path.join(os.path.dirname(directory),
                        f".gc-{os.path.basename(directory)}-{uuid.uuid4().hex[:8]}")
    os.rename(directory, tomb)
    if strangers := _clear_own(tomb):
        log.warning("fast_tier_gc_left_unknown_files", run_dir=directory,
                    entries=sorted(strangers)[:20])
        with contextlib.suppress(OSError):  # an activity made the directory anew meanwhile
            os.rename(tomb, directory)
        return False
    return True


def _clear_own(directory: str) -> list[str]:
    """Remove what the fast tier puts in a run's directory (OWN_DIRS, OWN_FILES), then the
    directory if that was all; returns the other entries (then it all stays but OWN_DIRS)."""
    for entry in OWN_DIRS:
        path = os.path.join(directory, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
    strangers = [e for e in os.listdir(directory)
                 if e not in OWN_FILES and not e.startswith(f".{RUN_FILE}.")]
    if strangers:
        return strangers
    for entry in os.listdir(directory):
        os.unlink(os.path.join(directory, entry))
    os.rmdir(directory)
    return []


def sweep_leftovers(root: str, *, stale_s: float = STALE_S,
                    now: float | None = None) -> list[str]:
    """Remove the `.gc-*` and `.new-*` directories under `root` (LEFTOVERS) untouched for
    `stale_s` whose lease nobody holds; returns them. Unknown files in one stay (logged)."""
    now = time.time() if now is None else now
    swept = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # another collection swept it
        if not (name.startswith(LEFTOVERS) and stat.S_ISDIR(st.st_mode)) \
                or now - max(st.st_mtime, st.st_ctime) < stale_s:
            continue
        with _try_hold(path) as free:
            if not free:
                continue  # a live collector is emptying it
            try:
                strangers = _clear_own(path)
            except OSError as exc:
                log.warning("fast_tier_leftover_skipped", path=path, error=repr(exc)[:300])
                continue
        if strangers:
            log.warning("fast_tier_gc_left_unknown_files", run_dir=path,
                        entries=sorted(strangers)[:20])
        else:
            swept.append(path)
    if swept:
        log.info("fast_tier_leftovers_swept", removed=swept)
    return swept


def release(fast_root: str, run_id: str) -> None:
    """(Holding the run's lease.) A finished run: its checkpoints on this machine are no
    longer needed. The segments'
    small local records (progress files, child logs, results) stay for a post-incident look
    and the benchmarks; the next `collect_garbage` on this machine removes the run's
    directory whole, since no checkpoint is left in it."""
    shutil.rmtree(store_dir(fast_root, run_id), ignore_errors=True)
    log.info("fast_tier_released", run_id=run_id)


def ensure_space(path: str, need_bytes: int, *, field: str = "storage.fast") -> None:
    """Fail at once, not retried, when the disk cannot hold the checkpoints a segment keeps
    there (a disk that stays full would otherwise fail every retry for days)."""
    from storage.tiered import free_bytes

    free = free_bytes(path)
    if free is not None and free < need_bytes:
        raise DiskFull(path, free, need_bytes, field)

