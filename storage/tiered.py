"""Tiered asynchronous checkpointing: save to local disk in the loop, commit in another process.

The step loop writes a snapshot to the fast tier (a local CheckpointStore; DeepSpeed's
`save_checkpoint` writes there directly) and calls `submit()`, which returns at once
unless `max_in_flight` snapshots are already waiting (then it blocks and emits
`checkpoint_backpressure`). Everything after that runs in a child process
(`storage.tiered_writer`, nice 10): hash the files and commit the fast tier's manifest
right away, upload them to the durable tier, write the durable manifest last (the commit
point). The training process only exchanges one-line JSON messages with it; a thread here
reads the answers and calls `on_commit` — the only place progress/heartbeats learn about a
commit (DESIGN §3). A process, not a thread: the S3 client (aiohttp, botocore) runs Python
for every chunk it sends, and in-process that took the loop's GIL (measured: 1.25–1.70x
step time during uploads with a thread; see docs/decisions.md).

While the durable tier is unreachable the writer retries with exponential backoff
(`durable_unavailable` once, `durable_recovered` when an upload succeeds again), and
training continues: a queued snapshot that has not started uploading is superseded by a
newer one (`checkpoint_superseded`) instead of blocking the loop.

A multi-node segment has one checkpointer per node (its local rank 0), each with the
node's own fast tier: `node_rank`, `nnodes` and `session` (unique to the launch) go to its
writer. Node k > 0 hands over its part (said as `committed` with `part: true`: not a
commit, so no `on_commit`); node 0's writer commits once every part of the session is
durable. A resume then comes from the durable tier (`resume(fast=False)`): a node's fast
tier holds only its own ranks' files.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from common.errors import BadConfig, StorageUnavailable
from common.procs import allowed_env, with_repo_on_path
from common.telemetry import child_trace_env
from storage.checkpoints import (
    CheckpointManifest,
    CheckpointStore,
    CorruptCheckpoint,
)
from storage.resume import choose
from storage.retention import RetentionPolicy
from storage.rollback import LINEAGE, start_lineage
from storage.tiered_writer import WriterConfig, gang_problem, manifest_meta

log = structlog.get_logger(__name__)

OnCommit = Callable[[CheckpointManifest, str], None]
CLOSE_TIMEOUT_S = 30.0  # close() lets an upload in progress finish this long, then kills it


@dataclass(frozen=True, kw_only=True)
class TierPolicy:
    max_in_flight: int = 2  # snapshots on the fast tier not yet durable (bounds disk and RAM)
    retry_s: float = 1.0  # first upload backoff; doubles up to retry_max_s
    retry_max_s: float = 30.0
    drain_timeout_s: float = 900.0
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)

    @classmethod
    def from_storage(cls, cfg: Any, min_horizon: int = 0) -> TierPolicy:
        """From spec.StorageConfig (validated there); retention keeps at least
        `min_horizon` steps of rollback reach (the spike detector's, retention.spike_reach)."""
        return cls(max_in_flight=cfg.max_in_flight, retry_s=cfg.upload_retry_s,
                   retry_max_s=cfg.upload_retry_max_s, drain_timeout_s=cfg.drain_timeout_s,
                   retention=RetentionPolicy(keep_last=cfg.keep_last, keep_every=cfg.keep_every,
                                             rollback_horizon=max(cfg.rollback_horizon,
                                                                  min_horizon)))


class CheckpointWriterFailed(RuntimeError):
    """The writer process stopped on an error that is not an outage (or died): no more
    uploads. Retryable as a crash; committed checkpoints on both tiers are intact."""

    def __init__(self, step: int | None, error: str, exit_code: int | None = None) -> None:
        self.step, self.error, self.exit_code = step, error, exit_code
        super().__init__(f"checkpoint writer failed at step {step}: {error}"
                         + (f" (exit code {exit_code})" if exit_code is not None else ""))


def free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or "/")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def start_writer(durable: CheckpointStore, fast: CheckpointStore, policy: TierPolicy, *,
                 node_rank: int = 0, nnodes: int = 1, session: str = "",
                 parts_timeout_s: float = 900.0) -> subprocess.Popen:
    """The writer process (`python -m storage.tiered_writer`): it arms PR_SET_PDEATHSIG
    itself, so it dies with the thread that starts it here — keep that thread alive.
    `node_rank`/`nnodes`/`session`: its place in a multi-node gang (module doc)."""
    if durable.url.startswith("memory://"):
        raise BadConfig("storage.durable", "a memory:// store lives inside one process, and "
                        "checkpoints are uploaded by a separate writer process",
                        "use a local path, file:// or s3:// URL")
    if problem := gang_problem(node_rank, nnodes, session):
        raise ValueError(f"checkpoint writer: {problem}")
    cfg = WriterConfig(durable_url=durable.url, durable_root=durable.root, fast_dir=fast.root,
                       retry_s=policy.retry_s, retry_max_s=policy.retry_max_s,
                       retention=asdict(policy.retention), parent_pid=os.getpid(),
                       run_id=durable.run_id, node_rank=node_rank, nnodes=nnodes,
                       session=session, parts_timeout_s=parts_timeout_s)
    # Only what an upload needs (storage credentials, the interpreter): never the worker's
    # Temporal credentials.
    env = with_repo_on_path(allowed_env())
    proc = subprocess.Popen([sys.executable, "-m", "storage.tiered_writer", cfg.to_json()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                            bufsize=1)
    log.info("checkpoint_writer_started", pid=proc.pid, durable=durable.url, fast=fast.root,
             node_rank=node_rank, nnodes=nnodes, launch=session)  # a `session` key is masked
    return proc


@dataclass(kw_only=True)
class _Job:
    step: int
    meta: dict[str, Any]
    write: Callable[[str], None] | None = None  # writes the fast tier off the loop's thread
    link: str = ""  # the traceparent of the span that submitted it (its upload links to it)


QUEUED, UPLOADING = "queued", "uploading"  # a pending step's state, as the writer last said


class TieredCheckpointer:
    """Fast tier (local) → durable tier (any fsspec URL) through a bounded writer process."""

    def __init__(self, durable: CheckpointStore, fast: CheckpointStore, policy: TierPolicy, *,
                 events: Any = None, on_commit: OnCommit | None = None, node_rank: int = 0,
                 nnodes: int = 1, session: str = "", parts_timeout_s: float = 900.0) -> None:
        self.durable, self.fast, self.policy = durable, fast, policy
        self.events, self.on_commit = events, on_commit
        self.node_rank, self.nnodes, self.session = node_rank, nnodes, session
        self._pending: dict[int, str] = {}  # submitted, not yet durable: step -> state
        self._outbox: collections.deque[_Job | dict[str, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._error: BaseException | None = None
        self._outage_since: float | None = None
        self.committed: list[int] = []  # durable commits made by this checkpointer, in order
        self.parts: list[int] = []  # steps whose part this node (k > 0) handed to node 0
        self.last_step: int | None = None  # newest snapshot submitted (the next one's parent)
        self.lineage = 0  # what the snapshots submitted now carry (storage/rollback.py)
        self._proc = start_writer(durable, fast, policy, node_rank=node_rank, nnodes=nnodes,
                                  session=session, parts_timeout_s=parts_timeout_s)
        self.writer_pid = self._proc.pid
        self._feeder = threading.Thread(target=self._feed, name="ckpt-feeder", daemon=True)
        self._reader = threading.Thread(target=self._read, name="ckpt-reader", daemon=True)
        self._feeder.start()
        self._reader.start()

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
        writes them there from a background thread of this process — then it must own a
        snapshot of the state (e.g. tensors copied to CPU memory), which is what
        `max_in_flight` bounds. `meta` (the manifest's fields) must be JSON-serialisable.
        """
        self._raise_if_failed()
        if LINEAGE not in meta.get("extra", {}):  # (a re-upload keeps its own)
            meta = {**meta, "extra": {**meta.get("extra", {}), LINEAGE: self.lineage}}
        t0 = time.perf_counter()
        with self._cond:
            while self._full() and self._error is None:
                waiting = [s for s, state in self._pending.items() if state == QUEUED]
                if self._outage_since is not None and waiting:
                    self._supersede(max(waiting), by_step=step)
                    break
                self._cond.wait(0.2)
            self._pending[step] = QUEUED
            self._outbox.append(_Job(step=step, meta=meta, write=write,
                                     link=child_trace_env().get("TRACEPARENT", "")))
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            self._cond.notify_all()
        waited = time.perf_counter() - t0
        if waited > 0.01:
            self._emit("checkpoint_backpressure", step=step, waited_s=round(waited, 3),
                       max_in_flight=self.policy.max_in_flight)
            log.warning("checkpoint_backpressure", step=step, waited_s=round(waited, 3))
        self._raise_if_failed()
        return waited

    def _supersede(self, old: int, *, by_step: int) -> None:
        """(Holding _cond.) Drop a queued snapshot for a newer one while uploads cannot run.
        It stays committed on the fast tier. If the writer started its upload just now,
        that upload still commits; the event then overstates, the data never does."""
        del self._pending[old]
        queued = [j for j in self._outbox if isinstance(j, _Job) and j.step == old]
        for job in queued:
            self._outbox.remove(job)
        if not queued:
            self._outbox.append({"op": "cancel", "step": old})
        self._emit("checkpoint_superseded", step=old, by_step=by_step,
                   event_id=f"checkpoint_superseded/{old}", reason="durable tier unavailable")

    def _full(self) -> bool:
        return len(self._pending) >= self.policy.max_in_flight

    def in_flight(self) -> list[int]:
        with self._cond:
            return sorted(self._pending)

    def drain(self, timeout_s: float | None = None) -> None:
        """Block until every submitted snapshot is durable; StorageUnavailable on timeout."""
        timeout_s = self.policy.drain_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageUnavailable(self.durable.url, f"uploads of steps "
                                             f"{sorted(self._pending)} still pending after "
                                             f"{timeout_s:.0f}s; they stay on the fast tier")
                self._cond.wait(min(left, 0.5))
        self._raise_if_failed()

    def close(self) -> None:
        """Stop the writer (pending snapshots stay on the fast tier for a later resume); an
        upload in progress may finish for CLOSE_TIMEOUT_S, then the writer is killed —
        its half-uploaded files have no manifest, so nobody sees them."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._feeder.join(timeout=10)
        try:
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("checkpoint_writer_killed", pid=self._proc.pid, pending=self.in_flight())
            self._proc.kill()
            self._proc.wait()
        self._reader.join(timeout=10)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- talking to the writer process -------------------------------------------------
    def _feed(self) -> None:
        """Hand jobs to the writer in order; a job's `write` runs here, off the loop."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._outbox or self._closing)
                if self._closing:
                    break
                item = self._outbox.popleft()
            if isinstance(item, _Job):
                item = self._written(item)
            if item is not None and not self._send(item):
                return
        self._send({"op": "close"})
        try:
            self._proc.stdin.close()
        except OSError:
            pass

    def _written(self, job: _Job) -> dict[str, Any] | None:
        """The writer's `job` message once the snapshot is on the fast tier (None: dropped)."""
        if job.write is not None:
            try:
                job.write(self.prepare(job.step))
            except OSError as exc:
                self._fail(self.write_failed(job.step, exc))
                return None
            except BaseException as exc:
                log.exception("checkpoint_snapshot_write_failed", step=job.step)
                self._fail(exc)
                return None
            job.write = None  # drop the snapshot's memory as soon as it is on disk
        with self._cond:
            if job.step not in self._pending:  # superseded while it was being written
                return None
        return {"op": "job", "step": job.step, "meta": job.meta, "link": job.link}

    def _send(self, msg: dict[str, Any]) -> bool:
        try:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()
            return True
        except (BrokenPipeError, ValueError, OSError):  # the writer is gone: _read says why
            return False

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                self._handle(json.loads(line))
            except Exception as exc:  # e.g. on_commit failed: stop as the uploader would
                log.exception("checkpoint_writer_message_failed", line=line[:200])
                self._fail(exc)
        code = self._proc.wait()
        with self._cond:
            if not self._closing and self._error is None:
                log.error("checkpoint_writer_died", pid=self._proc.pid, exit_code=code)
                self._error = CheckpointWriterFailed(None, "the writer process exited", code)
            self._cond.notify_all()

    def _handle(self, msg: dict[str, Any]) -> None:
        op, step = msg["op"], msg.get("step")
        if op == "started":
            with self._cond:
                if step in self._pending:
                    self._pending[step] = UPLOADING
        elif op == "committed" and msg.get("part"):  # node 0 commits it: not a durable fact
            self.parts.append(step)
            log.info("checkpoint_part_handed_over", step=step, node_rank=msg.get("node_rank"))
        elif op == "committed":  # before `done`, so drain() waits for on_commit
            self.committed.append(step)
            if self.on_commit:
                self.on_commit(CheckpointManifest.from_json(msg["manifest"]), msg["uri"])
        elif op == "done":
            with self._cond:
                self._pending.pop(step, None)
                self._cond.notify_all()
        elif op == "event":
            if msg["kind"] in ("durable_unavailable", "durable_recovered"):
                down = msg["kind"] == "durable_unavailable"
                self._outage_since = time.monotonic() if down else None
            self._emit(msg["kind"], msg["payload"], step=step, event_id=msg["event_id"])
            if msg["flush"]:
                self._flush()
        elif op == "failed":
            self._fail(self._writer_error(msg))

    def _writer_error(self, msg: dict[str, Any]) -> BaseException:
        if msg["kind"] == "StorageUnavailable":
            return StorageUnavailable(msg["url"], msg["cause"])
        if msg["stage"] == "fast" and msg["errno"] is not None:  # e.g. disk full: the manifest
            return self.write_failed(msg["step"], OSError(msg["errno"], msg["error"]))
        return CheckpointWriterFailed(msg["step"], msg["error"])

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    # ---- lineage and resume -----------------------------------------------------------
    def branch(self, restored_step: int, newer: list[int]) -> int:
        """A rollback restored `restored_step`: record the new lineage on the durable tier
        (before anything newer is uncommitted: storage/rollback.py) and carry it from now on."""
        self.lineage = start_lineage(self.durable, restored_step, newer)
        return self.lineage

    def resume(self, local_root: str, at_or_before: int | None,
               on_corrupt: Callable[[CorruptCheckpoint], None] | None = None, *,
               fast: bool = True) -> tuple[CheckpointManifest, str, str] | None:
        """(manifest, load_root, tier) of the newest checkpoint that verifies on either tier
        and whose lineage no rollback has left (storage/resume.py); fast-only steps newer
        than the durable tier's newest are queued for upload so it catches up, and from
        here on snapshots carry the run's current lineage. `fast=False` never picks (nor
        touches) a fast copy: on a multi-node segment a node's fast tier holds only its
        own ranks' files, which verify but are not the whole checkpoint — only the
        durable manifest lists every rank's.
        """
        choice = choose(self.fast if fast else None, self.durable, local_root, at_or_before,
                        on_corrupt)
        self.lineage = choice.lineage
        for step in choice.upload:
            log.info("checkpoint_upload_resumed", step=step)
            self.submit(step, **manifest_meta(self.fast.manifest(step)))
        return choice.found

    def _emit(self, kind: str, payload: dict[str, Any] | None = None, /, *,
              step: int | None, event_id: str | None = None, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, {**(payload or {}), **fields}, step=step, event_id=event_id)

    def _flush(self) -> None:
        if self.events is None:
            return
        try:
            self.events.flush()
        except StorageUnavailable as exc:  # the batch stays buffered for the next flush
            log.warning("event_flush_deferred", error=exc.cause[:200])
