"""Tiered asynchronous checkpointing: save to local disk in the loop, upload in the background.

The step loop writes a snapshot to the fast tier (a local CheckpointStore; DeepSpeed's
`save_checkpoint` writes there directly) and calls `submit()`, which returns at once
unless `max_in_flight` snapshots are already waiting (then it blocks and emits
`checkpoint_backpressure`). One background thread, per snapshot and in step order:
hashes the files and commits the fast tier's manifest, uploads the files to the durable
tier, writes the durable manifest last (the commit point), then calls `on_commit` — the
only place progress/heartbeats learn about a commit (DESIGN §3). Hashing (hashlib) and
file/socket I/O release the GIL, so the loop keeps its interpreter.

While the durable tier is unreachable the uploader retries with exponential backoff
(`durable_unavailable` once, `durable_recovered` when an upload succeeds again), and
training continues: a queued snapshot that has not started uploading is superseded by a
newer one (`checkpoint_superseded`) instead of blocking the loop.
"""

from __future__ import annotations

import collections
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from ops.errors import StorageUnavailable
from storage.checkpoints import (
    MANIFEST,
    CheckpointManifest,
    CheckpointStore,
    CorruptCheckpoint,
    step_dir,
)
from storage.retention import RetentionPolicy, apply_retention

log = structlog.get_logger(__name__)

OnCommit = Callable[[CheckpointManifest, str], None]
UPLOADER_NICE = 10  # hashing + upload run at lower priority than the training loop
# While the uploader runs Python (aiohttp, pickling), the loop waits for the GIL after each
# torch op that released it: up to the switch interval (5 ms default) per op. With 0.5 ms one
# run of benchmarks/checkpoint_stall.py went from 1.52x to 1.29x step-time slowdown during
# S3 uploads (single runs on a loaded 2-core machine: noisy, see docs/decisions.md).
GIL_SWITCH_S = 0.0005


@dataclass(frozen=True, kw_only=True)
class TierPolicy:
    max_in_flight: int = 2  # snapshots on the fast tier not yet durable (bounds disk and RAM)
    retry_s: float = 1.0  # first upload backoff; doubles up to retry_max_s
    retry_max_s: float = 30.0
    drain_timeout_s: float = 900.0
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)

    @classmethod
    def from_storage(cls, cfg: Any) -> TierPolicy:
        """From ops.spec.StorageConfig (validated there)."""
        return cls(max_in_flight=cfg.max_in_flight, retry_s=cfg.upload_retry_s,
                   retry_max_s=cfg.upload_retry_max_s, drain_timeout_s=cfg.drain_timeout_s,
                   retention=RetentionPolicy(keep_last=cfg.keep_last, keep_every=cfg.keep_every,
                                             rollback_horizon=cfg.rollback_horizon))


def next_backoff(current: float, policy: TierPolicy) -> float:
    return min(current * 2, policy.retry_max_s)


def free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or "/")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


@dataclass(kw_only=True)
class _Job:
    step: int
    meta: dict[str, Any]
    write: Callable[[str], None] | None = None  # writes the fast tier off the loop's thread


class TieredCheckpointer:
    """Fast tier (local) → durable tier (any fsspec URL) with a bounded background uploader."""

    def __init__(self, durable: CheckpointStore, fast: CheckpointStore, policy: TierPolicy, *,
                 events: Any = None, on_commit: OnCommit | None = None) -> None:
        self.durable, self.fast, self.policy = durable, fast, policy
        self.events, self.on_commit = events, on_commit
        self._queue: collections.deque[_Job] = collections.deque()
        self._busy: _Job | None = None  # the job being uploaded (not in _queue)
        self._cond = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._outage_since: float | None = None
        self.committed: list[int] = []  # durable commits made by this checkpointer, in order
        self.last_step: int | None = None  # newest snapshot submitted (the next one's parent)
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self._thread = threading.Thread(target=self._run, name="ckpt-uploader", daemon=True)
        self._thread.start()

    # ---- the loop's side -------------------------------------------------------------
    def prepare(self, step: int) -> str:
        """The fast-tier directory to write step's files into, cleared of any partial save."""
        path = self.fast.path(step)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
        return path

    def write_failed(self, step: int, exc: BaseException) -> StorageUnavailable:
        """Writing the fast tier failed (disk full, I/O error): clean up, say so, and return
        the retryable error to raise. Committed checkpoints on both tiers are untouched."""
        path = self.fast.path(step)
        shutil.rmtree(path, ignore_errors=True)
        free = free_bytes(path)
        errno = getattr(exc, "errno", None)
        self._emit("checkpoint_failed", step=step, event_id=f"checkpoint_failed/{step}/fast",
                   tier="fast", path=path, error=repr(exc)[:500], errno=errno, free_bytes=free,
                   reason="disk_full" if errno == 28 or "No space" in str(exc) else "io_error")
        self._flush()
        return StorageUnavailable(self.fast.url, f"writing checkpoint step {step} to the fast "
                                  f"tier failed: {exc!r} ({free} bytes free)")

    def submit(self, step: int, write: Callable[[str], None] | None = None, **meta: Any) -> float:
        """Queue step for commit; returns the seconds the loop waited for a free slot.

        Either the files are already under prepare(step) (DeepSpeed wrote them), or `write`
        writes them there from the uploader thread — then it must own a snapshot of the
        state (e.g. tensors copied to CPU memory), which is what `max_in_flight` bounds.
        """
        self._raise_if_failed()
        t0 = time.perf_counter()
        with self._cond:
            while self._full() and self._error is None:
                if self._outage_since is not None and self._queue:
                    old = self._queue.pop()  # newest queued, not yet uploading
                    self._emit("checkpoint_superseded", step=old.step, by_step=step,
                               event_id=f"checkpoint_superseded/{old.step}",
                               reason="durable tier unavailable")
                    break
                self._cond.wait(0.2)
            self._queue.append(_Job(step=step, meta=meta, write=write))
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            self._cond.notify_all()
        waited = time.perf_counter() - t0
        if waited > 0.01:
            self._emit("checkpoint_backpressure", step=step, waited_s=round(waited, 3),
                       max_in_flight=self.policy.max_in_flight)
            log.warning("checkpoint_backpressure", step=step, waited_s=round(waited, 3))
        self._raise_if_failed()
        return waited

    def _full(self) -> bool:
        return len(self._queue) + (self._busy is not None) >= self.policy.max_in_flight

    def in_flight(self) -> list[int]:
        with self._cond:
            return ([self._busy.step] if self._busy else []) + [j.step for j in self._queue]

    def drain(self, timeout_s: float | None = None) -> None:
        """Block until every submitted snapshot is durable; StorageUnavailable on timeout."""
        timeout_s = self.policy.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._queue or self._busy) and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageUnavailable(self.durable.url, f"uploads of steps "
                                             f"{self.in_flight_locked()} still pending after "
                                             f"{timeout_s:.0f}s; they stay on the fast tier")
                self._cond.wait(min(left, 0.5))
        self._raise_if_failed()

    def in_flight_locked(self) -> list[int]:
        return ([self._busy.step] if self._busy else []) + [j.step for j in self._queue]

    def close(self) -> None:
        """Stop the uploader (pending snapshots stay on the fast tier for a later resume)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- resume ----------------------------------------------------------------------
    def resume(self, local_root: str, at_or_before: int | None,
               on_corrupt: Callable[[CorruptCheckpoint], None] | None = None,
               ) -> tuple[CheckpointManifest, str, str] | None:
        """(manifest, load_root, tier) of the newest checkpoint that verifies on either tier.

        A fast-tier copy is verified by hashing it in place and loads from `fast.root`; a
        durable one is fetched (verified while copying) into `local_root/step-…`. A corrupt
        copy is reported and skipped (a corrupt fast copy is deleted). Fast-only steps
        newer than the durable tier's newest are queued for upload so it catches up.
        """
        def wanted(steps: list[int]) -> list[int]:
            return [s for s in steps if at_or_before is None or s <= at_or_before]

        fast, durable = wanted(self.fast.list_committed()), wanted(self.durable.list_committed())
        for step in sorted(set(fast) | set(durable), reverse=True):
            if step in fast:
                problems = self.fast.verify(step)
                if not problems:
                    self._catch_up([s for s in fast if s <= step and s not in durable
                                    and (not durable or s > durable[-1])])
                    return self.fast.manifest(step), self.fast.root, "fast"
                _tell(problems[0], on_corrupt)
                self.fast.delete(step)
            if step in durable:
                try:
                    man = self.durable.fetch(step, os.path.join(local_root, step_dir(step)))
                    return man, local_root, "durable"
                except CorruptCheckpoint as exc:
                    _tell(exc, on_corrupt)
        return None

    def _catch_up(self, steps: list[int]) -> None:
        for step in steps:
            log.info("checkpoint_upload_resumed", step=step)
            self.submit(step, **_meta_of(self.fast.manifest(step)))

    # ---- the uploader thread ---------------------------------------------------------
    def _run(self) -> None:
        _lower_priority()
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                self._busy = self._queue.popleft()
            try:
                self._commit(self._busy)
            except BaseException as exc:
                log.exception("checkpoint_upload_failed", step=self._busy.step)
                self._error = exc
            with self._cond:
                self._busy = None
                self._cond.notify_all()
                if self._error is not None:
                    return

    def _fast_commit(self, job: _Job) -> CheckpointManifest:
        if self.fast.fs.exists(self.fast.path(job.step, MANIFEST)):
            return self.fast.manifest(job.step)
        if job.write is not None:
            try:
                job.write(self.prepare(job.step))
            except OSError as exc:
                raise self.write_failed(job.step, exc) from exc
            job.write = None  # drop the snapshot's memory as soon as it is on disk
        return self.fast.commit_in_place(job.step, **job.meta)

    def _fast_commit_queued(self) -> None:
        """While uploads wait out an outage, make every queued snapshot resumable locally."""
        with self._cond:
            queued = list(self._queue)
        for job in queued:
            self._fast_commit(job)

    def _commit(self, job: _Job) -> None:
        fast_man = self._fast_commit(job)
        backoff, tries = self.policy.retry_s, 0
        while True:
            try:
                man = self.durable.commit(job.step, self.fast.path(job.step),
                                          files=fast_man.files, **_meta_of(fast_man))
                break
            except StorageUnavailable as exc:
                tries += 1
                self._outage(job.step, exc, backoff)
                self._fast_commit_queued()
                with self._cond:
                    if self._cond.wait_for(lambda: self._closing, timeout=backoff):
                        return
                backoff = next_backoff(backoff, self.policy)
        self._recovered(job.step, tries)
        self.committed.append(job.step)
        if self.on_commit:
            self.on_commit(man, self.durable.uri(job.step))
        try:
            apply_retention(self.durable, self.policy.retention, newest_verified=job.step)
        except StorageUnavailable as exc:  # retention is retried after the next commit
            log.warning("retention_deferred", step=job.step, error=exc.cause[:200])
        for old in self.fast.list_committed():  # the fast tier keeps the newest durable copy
            if old < job.step and old not in self.in_flight():
                self.fast.delete(old)

    def _outage(self, step: int, exc: StorageUnavailable, retry_in: float) -> None:
        first = self._outage_since is None
        if first:
            self._outage_since = time.monotonic()
            self._emit("durable_unavailable", step=step, uri=self.durable.url,
                       error=exc.cause[:300], retry_in_s=retry_in)
        log.warning("checkpoint_upload_retry", step=step, error=exc.cause[:200], retry_in_s=retry_in)

    def _recovered(self, step: int, tries: int) -> None:
        if self._outage_since is None:
            return
        outage_s = round(time.monotonic() - self._outage_since, 2)
        self._outage_since = None
        self._emit("durable_recovered", step=step, uri=self.durable.url, outage_s=outage_s,
                   failed_uploads=tries)
        self._flush()

    def _emit(self, kind: str, *, step: int | None, event_id: str | None = None,
              **payload: Any) -> None:
        if self.events is not None:
            self.events.record(kind, step, event_id, payload)

    def _flush(self) -> None:
        if self.events is None:
            return
        try:
            self.events.flush()
        except StorageUnavailable as exc:  # the batch stays buffered for the next flush
            log.warning("event_flush_deferred", error=exc.cause[:200])


def _lower_priority() -> None:
    """Background work yields the CPU to the step loop (Linux nice is per thread): this
    thread, and fsspec's event-loop thread, which runs every async (S3) transfer."""
    import fsspec.asyn

    fsspec.asyn.get_loop()  # starts the I/O thread if it is not running yet
    io_thread = fsspec.asyn.iothread[0]
    for tid in {threading.get_native_id(), getattr(io_thread, "native_id", None)} - {None}:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, UPLOADER_NICE)
        except (AttributeError, OSError) as exc:
            log.info("uploader_priority_unchanged", thread=tid, error=repr(exc))


def _tell(exc: CorruptCheckpoint, on_corrupt: Callable[[CorruptCheckpoint], None] | None) -> None:
    log.warning("checkpoint_corrupt", step=exc.step, file=exc.file, expected=exc.expected,
                actual=exc.actual)
    if on_corrupt:
        on_corrupt(exc)


def _meta_of(man: CheckpointManifest) -> dict[str, Any]:
    return {"tokens_seen": man.tokens_seen, "data_cursor": man.data_cursor,
            "skip_ranges": man.skip_ranges, "detector_state": man.detector_state,
            "config_hash": man.config_hash, "parent": man.parent, "writer": man.writer,
            "extra": man.extra}
