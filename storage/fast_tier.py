"""The fast tier on a trainer machine's local disk: one checkpoint store per run, bounded.

Layout under `storage.fast`: `<run_id>/ckpt/step-…/` (the run's fast-tier store, shared
by all its segments on this machine, so the writer's cleanup — keep the newest durable
copy and what is still uploading — spans segments), `<run_id>/segments/<lo>-<hi>/` (each
segment's progress file, logs, result), `<run_id>/cache/` (verified copies of the dataset's shards and the event log's batches, so
a restart here does not fetch them again), `<run_id>/fast.json` (which durable store the run
commits to) and `<run_id>/.lease` (held with flock while an activity of the run uses it).

Issue 11: each segment had its own store and nothing removed a finished segment's
checkpoints, so the local disk filled linearly with segments. Now:
- a run's fast store is one directory, cleaned after every durable commit;
- before an activity uses the fast tier, `collect_garbage` visits the other runs on this
  machine that no activity holds: a fast copy that is committed on the durable tier is
  only a cache and goes; a fast-only snapshot newer than the durable tier's newest (its
  upload never finished) is the only copy of that progress and stays; a run directory
  left with no checkpoint is removed whole (finished runs end up here);
- `release` removes a finished run's checkpoints on the machine that evaluates it; the
  run's segment records go with the next collection there.
The fast tier never holds the only copy of anything this deletes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator

import structlog

from common.errors import DiskFull, StorageUnavailable
from storage.checkpoints import CheckpointStore

log = structlog.get_logger(__name__)

RUN_FILE = "fast.json"
LEASE_FILE = ".lease"


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


def fast_steps_to_delete(fast: list[int], durable: list[int]) -> list[int]:
    """Pure: the fast copies another run no longer needs here — those committed durably,
    and fast-only ones at or below the durable newest (a resume never picks them over
    it). Fast-only snapshots newer than every durable commit are kept."""
    newest = max(durable, default=None)
    return sorted(s for s in fast if s in set(durable) or (newest is not None and s <= newest))


@contextlib.contextmanager
def lease(fast_root: str, run_id: str, durable_url: str) -> Iterator[str]:
    """Hold the run's directory for the length of an activity (garbage collection skips it);
    records the durable URL so a later collection can tell what is safe to delete."""
    directory = run_dir(fast_root, run_id)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, LEASE_FILE), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # one activity per run per machine at a time
        _write_run_file(directory, run_id, durable_url)
        try:
            yield directory
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _write_run_file(directory: str, run_id: str, durable_url: str) -> None:
    tmp = os.path.join(directory, f".{RUN_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"run_id": run_id, "durable": durable_url}, f)
    os.replace(tmp, os.path.join(directory, RUN_FILE))


def _held(directory: str) -> bool:
    path = os.path.join(directory, LEASE_FILE)
    if not os.path.exists(path):
        return False
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def collect_garbage(fast_root: str, keep_run: str) -> list[str]:
    """Free what other runs left on this machine's fast tier; returns what was removed.
    A run whose durable store cannot be reached now is left for a later collection."""
    root = os.path.abspath(fast_root)
    removed: list[str] = []
    if not os.path.isdir(root):
        return removed
    for name in sorted(os.listdir(root)):
        directory = os.path.join(root, name)
        if name == keep_run or not os.path.isfile(os.path.join(directory, RUN_FILE)) \
                or _held(directory):
            continue
        try:
            removed += _collect_run(directory)
        except Exception as exc:  # best effort: a cache cleanup never fails the activity
            log.warning("fast_tier_gc_skipped", run_dir=directory, error=repr(exc)[:300])
    if removed:
        log.info("fast_tier_gc", removed=removed)
    return removed


def _collect_run(directory: str) -> list[str]:
    with open(os.path.join(directory, RUN_FILE)) as f:
        info = json.load(f)
    fast = CheckpointStore.local(os.path.join(directory, "ckpt"))
    try:
        durable = CheckpointStore(info["durable"], info["run_id"]).list_committed()
    except StorageUnavailable:
        return []
    steps = fast.list_committed()
    doomed = fast_steps_to_delete(steps, durable)
    for step in doomed:
        fast.delete(step)
    if len(doomed) == len(steps):  # nothing here is the only copy of anything
        shutil.rmtree(directory, ignore_errors=True)
        return [directory]
    return [fast.path(s) for s in doomed]


def release(fast_root: str, run_id: str) -> None:
    """A finished run: its checkpoints on this machine are no longer needed. The segments'
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

