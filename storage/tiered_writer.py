"""The tiered checkpointer's writer process: hash, upload and commit, off the loop's GIL.

Started by `storage.tiered.TieredCheckpointer` as `python -m storage.tiered_writer CONFIG`.
It reads one JSON message per line on stdin (`job`, `cancel`, `close`) and answers one per
line on its original stdout (`started`, `committed`, `done`, `event`, `failed`); its own
logs go to stderr. Two threads, each in step order:

- fast: hash a submitted snapshot's files and write the fast tier's manifest at once, so
  every snapshot is resumable locally a moment after submit — even one queued behind a
  slow upload (before, a snapshot waiting for the uploader was lost on a kill).
- upload: put the files on the durable tier and write its manifest last (the commit
  point), retrying with exponential backoff while the durable tier is unreachable; then
  retention, and the fast tier keeps only the newest durable copy and what is in flight.

A multi-node segment runs one writer per node (`node_rank`, `nnodes`, `session`): a node
other than 0 puts its files on the durable tier and writes its part record
(`CheckpointStore.commit_part`); node 0 waits for every other node's part of this launch —
holding no lock meanwhile — and writes the one manifest that lists every rank's files.
Only node 0 applies retention; every node cleans its own fast tier.

The process runs at nice 10 and dies with its parent (PR_SET_PDEATHSIG, or stdin EOF), so a
SIGKILLed trainer never leaves it uploading; a half-finished upload has no manifest and
stays invisible (DESIGN §3).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import structlog

from common.errors import MainspringError, StorageUnavailable
from common.faults import Fault, fault_event
from storage.checkpoints import (
    MANIFEST,
    CheckpointManifest,
    CheckpointStore,
    FileEntry,
    union_files,
)
from storage.retention import RetentionPolicy, apply_retention
from storage.rollback import commit_unless_left_behind, left_behind, lineage_of

log = structlog.get_logger(__name__)

WRITER_NICE = 10  # below the training loop (nice 0): CFS gives it ~1/10 of a shared core
# Node 0 polls for the other nodes' parts this often, doubling up to the max: a part lands
# within a moment of its node's upload, and a poll is one small GET per node.
PARTS_POLL_S, PARTS_POLL_MAX_S = 0.2, 2.0

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class WriterConfig:
    """What the parent passes on the command line (JSON): where to read and write, how to retry."""

    durable_url: str
    durable_root: str  # CheckpointStore.root of the durable tier (runs/<id>/checkpoints)
    fast_dir: str
    retry_s: float
    retry_max_s: float
    retention: dict[str, int]
    parent_pid: int
    run_id: str = ""  # its spans go to this run's store (storage/spans.py)
    node_rank: int = 0  # this node in a multi-node segment; node 0 writes the manifest
    nnodes: int = 1
    session: str = ""  # unique to this launch of the gang: parts of other launches are stale
    parts_timeout_s: float = 900.0  # node 0 waits this long (the store answering) for parts

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> WriterConfig:
        return cls(**json.loads(text))


def gang_problem(node_rank: int, nnodes: int, session: str) -> str | None:
    """Why a writer cannot take this place in a gang (None: it can). Pure. A multi-node
    writer needs a session, or a part of an earlier launch would pass for this one's."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        return f"node_rank {node_rank} is not in 0..nnodes-1 (nnodes {nnodes})"
    if nnodes > 1 and not session:
        return "a multi-node writer needs a session (an id unique to this launch)"
    return None


class PartsMissing(RuntimeError):
    """Node 0 waited `parts_timeout_s` for other nodes' parts of a step and some never came
    (a node died, hangs or cannot reach the store): nothing is committed, the writer stops,
    and the segment is retried as after a crash."""

    def __init__(self, step: int, missing: list[int], session: str, waited_s: float) -> None:
        self.step, self.missing, self.session = step, missing, session
        super().__init__(f"checkpoint step {step}: no part from node(s) "
                         f"{', '.join(map(str, missing))} of session {session!r} after "
                         f"{waited_s:.0f}s; the step is not committed")


def missing_nodes(found: dict[int, Any], nnodes: int) -> list[int]:
    return [node for node in range(1, nnodes) if node not in found]


def next_backoff(current: float, retry_max_s: float) -> float:
    return min(current * 2, retry_max_s)


def manifest_meta(man: CheckpointManifest) -> dict[str, Any]:
    """The metadata a manifest carries over to its copy on the other tier."""
    return {"tokens_seen": man.tokens_seen, "data_cursor": man.data_cursor,
            "skip_ranges": man.skip_ranges, "detector_state": man.detector_state,
            "config_hash": man.config_hash, "parent": man.parent, "writer": man.writer,
            "extra": man.extra}


def meta_from_json(meta: dict[str, Any]) -> dict[str, Any]:
    """JSON turned skip_ranges' tuples into lists; the manifest keeps tuples."""
    if "skip_ranges" in meta:
        meta = {**meta, "skip_ranges": tuple(tuple(r) for r in meta["skip_ranges"])}
    return meta


def failure_message(step: int, stage: str, exc: BaseException) -> dict[str, Any]:
    """A `failed` message: enough for the parent to raise the same kind of error."""
    msg = {"op": "failed", "step": step, "stage": stage, "kind": type(exc).__name__,
           "error": repr(exc)[:1000], "errno": getattr(exc, "errno", None)}
    if isinstance(exc, StorageUnavailable):
        msg |= {"url": exc.url, "cause": exc.cause}
    elif isinstance(exc, MainspringError):
        msg["kind"] = exc.kind
    return msg


@dataclass(kw_only=True)
class _Job:
    step: int
    meta: dict[str, Any]
    manifest: CheckpointManifest | None = None  # the fast tier's, once hashed
    cancelled: bool = False  # superseded by the parent: commit locally, do not upload
    link: str = ""  # traceparent of the `checkpoint stage` span that submitted it


class Writer:
    """The two worker threads and the queues between stdin, them and the parent."""

    def __init__(self, cfg: WriterConfig, out: IO[str]) -> None:
        self.cfg, self._out, self._out_lock = cfg, out, threading.Lock()
        self.durable = CheckpointStore.at(cfg.durable_url, cfg.durable_root)
        self.fast = CheckpointStore.local(cfg.fast_dir)
        self.retention = RetentionPolicy(**cfg.retention)
        self._cond = threading.Condition()
        self._to_hash: collections.deque[_Job] = collections.deque()
        self._to_upload: collections.deque[_Job] = collections.deque()
        self._uploading: _Job | None = None
        self._closing = False
        self._outage_since: float | None = None
        self._outage_ts = 0.0  # when the outage began (wall clock): its fault event's id

    # ---- messages ------------------------------------------------------------------
    def send(self, **msg: Any) -> None:
        with self._out_lock:
            self._out.write(json.dumps(msg) + "\n")
            self._out.flush()

    def emit(self, kind: str, /, *, step: int, flush: bool = False, event_id: str | None = None,
             **payload: Any) -> None:
        self.send(op="event", kind=kind, step=step, event_id=event_id, flush=flush,
                  payload=payload)

    def fault(self, fault: Fault) -> None:
        """A `fault` event, the shape every detector writes (common/faults.py)."""
        kind, event_id, payload = fault_event(fault)
        self.send(op="event", kind=kind, step=fault.last_step, event_id=event_id or None,
                  flush=False, payload=payload)

    def handle(self, msg: dict[str, Any]) -> None:
        with self._cond:
            if msg["op"] == "job":
                self._to_hash.append(_Job(step=msg["step"], meta=meta_from_json(msg["meta"]),
                                          link=msg.get("link") or ""))
            elif msg["op"] == "cancel":
                self._cancel(msg["step"])
            elif msg["op"] == "close":
                self._closing = True
            self._cond.notify_all()

    def _cancel(self, step: int) -> None:
        """Superseded during an outage: drop it from the uploads unless it already started."""
        for job in self._to_hash:
            if job.step == step:
                job.cancelled = True
        for job in [j for j in self._to_upload if j.step == step]:
            self._to_upload.remove(job)
        log.info("checkpoint_upload_cancelled", step=step)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def _next(self, queue: collections.deque[_Job]) -> _Job | None:
        """The oldest job in `queue` (left there), waiting for one; None once closing."""
        with self._cond:
            self._cond.wait_for(lambda: queue or self._closing)
            return None if self._closing else queue[0]

    def in_flight(self) -> set[int]:
        with self._cond:
            jobs = [*self._to_hash, *self._to_upload, self._uploading]
            return {job.step for job in jobs if job is not None}

    # ---- fast thread: every snapshot resumable locally as soon as possible -----------
    def fast_loop(self) -> None:
        while (job := self._next(self._to_hash)) is not None:
            try:
                job.manifest = self._fast_commit(job)
            except BaseException as exc:
                log.exception("checkpoint_writer_failed", step=job.step, stage="fast")
                self._fail(job.step, "fast", exc)
                return
            with self._cond:
                self._to_hash.popleft()
                if not job.cancelled:
                    self._to_upload.append(job)
                self._cond.notify_all()

    def _fast_commit(self, job: _Job) -> CheckpointManifest:
        if self.fast.fs.exists(self.fast.path(job.step, MANIFEST)):
            return self.fast.manifest(job.step)  # a resume queued it again for upload
        man = self.fast.commit_in_place(job.step, **job.meta)
        log.info("checkpoint_fast_committed", step=job.step, bytes=man.total_bytes)
        return man

    # ---- upload thread: durable commit, manifest last ---------------------------------
    def upload_loop(self) -> None:
        while (job := self._next(self._to_upload)) is not None:
            with self._cond:
                self._to_upload.popleft()
                self._uploading = job
            self.send(op="started", step=job.step)
            try:
                uploaded = self._upload(job)
            except BaseException as exc:
                log.exception("checkpoint_writer_failed", step=job.step, stage="durable")
                self._fail(job.step, "durable", exc)
                return
            with self._cond:
                self._uploading = None
            if not uploaded:
                return  # closed while waiting out an outage
            self.send(op="done", step=job.step)

    def _upload(self, job: _Job) -> bool:
        """The job's durable commit, unless its lineage is left: before the upload (node 0
        reads the lineage records) or while it committed (a rollback elsewhere; the commit
        is taken back). False once closing."""
        if self.cfg.node_rank == 0 and self._abandoned(job):
            return True
        with upload_span(job, self.cfg.run_id):
            man = self._durable_commit(job)
        if man is None:
            return False
        if isinstance(man, int):
            self._refuse(job, man)
        else:
            self._after_commit(job.step, man)
        return True

    def _abandoned(self, job: _Job) -> bool:
        """Where commits are made (node 0): a snapshot whose lineage a rollback recorded on
        the durable tier has left (storage/rollback.py: a segment elsewhere rolled back
        after this one was written) is neither uploaded nor kept here. False once closing."""
        got = self._retrying(job.step, lambda: left_behind(
            self.durable, job.step, lineage_of(job.manifest)))
        if got is None or got[0] is None:
            return False
        self._refuse(job, got[0])
        return True

    def _refuse(self, job: _Job, current: int) -> None:
        """The snapshot's lineage is left: say so, and drop the fast copy."""
        lineage = lineage_of(job.manifest)
        log.warning("checkpoint_upload_refused", step=job.step, lineage=lineage,
                    current=current, reason="abandoned lineage")
        self.emit("checkpoint_abandoned", step=job.step, flush=True,
                  event_id=f"checkpoint_abandoned/{job.step}/{lineage}", lineage=lineage,
                  current_lineage=current)
        self.fast.delete(job.step)

    def _durable_commit(self, job: _Job) -> CheckpointManifest | int | None:
        """The step's durable share from this node; None once closing; the run's current
        lineage when a rollback left the snapshot's while it committed. One node: the
        commit. Node k > 0: its part (then the fast tier's manifest is returned, its own
        files). Node 0 of several: every part of this launch, then the one commit."""
        if self.cfg.nnodes == 1:
            got = self._retrying(job.step, lambda: self._commit(job, remote=None))
        elif self.cfg.node_rank > 0:
            got = self._retrying(job.step, lambda: self._commit_part(job))
        else:
            return self._commit_gang(job)
        return None if got is None else got[0]

    def _commit(self, job: _Job, remote: dict[str, FileEntry] | None,
                ) -> CheckpointManifest | int:
        """The durable commit, the lineage records read again after it (`_abandoned` read
        them before: a rollback elsewhere cannot slip in between; storage/rollback.py
        commit_unless_left_behind)."""
        fast_man = job.manifest
        return commit_unless_left_behind(
            self.durable, job.step, lineage_of(fast_man), lambda: self.durable.commit(
                job.step, self.fast.path(job.step), files=fast_man.files, remote=remote,
                **manifest_meta(fast_man)))

    def _commit_part(self, job: _Job) -> CheckpointManifest:
        self.durable.commit_part(job.step, self.fast.path(job.step), files=job.manifest.files,
                                 node_rank=self.cfg.node_rank, session=self.cfg.session)
        return job.manifest

    def _commit_gang(self, job: _Job) -> CheckpointManifest | int | None:
        """Node 0: wait (no lock held: the other nodes take the step's lock to write their
        parts) until every other node's part of this session is there, then commit this
        node's files with theirs. A step committed already (a retry of it) is not waited for."""
        found = self._await_parts(job.step)
        if found is None or isinstance(found, CheckpointManifest):
            return found
        remote = union_files(job.step, self.durable.path(job.step), *found.values())
        got = self._retrying(job.step, lambda: self._commit(job, remote=remote))
        return None if got is None else got[0]

    def _await_parts(self, step: int,
                     ) -> dict[int, dict[str, FileEntry]] | CheckpointManifest | None:
        """Poll (PARTS_POLL_S doubling to PARTS_POLL_MAX_S) until every other node's part of
        this session is there — or the step's manifest, once committed. None once closing;
        PartsMissing after `parts_timeout_s` of polls the store answered (an outage is
        waited out as uploads are, and does not count: the other nodes wait it out too)."""
        t0, outages, poll = time.monotonic(), 0.0, PARTS_POLL_S
        while True:
            got = self._retrying(step, lambda: self._poll_parts(step))
            if got is None:
                return None
            found, outage_s = got
            outages += outage_s
            waited = time.monotonic() - t0
            missing = [] if isinstance(found, CheckpointManifest) else missing_nodes(
                found, self.cfg.nnodes)
            if not missing:
                log.info("checkpoint_parts_waited", step=step, nodes=self.cfg.nnodes,
                         waited_s=round(waited, 3), committed=isinstance(found,
                                                                         CheckpointManifest))
                return found
            if waited - outages > self.cfg.parts_timeout_s:
                log.error("checkpoint_parts_missing", step=step, nodes=self.cfg.nnodes,
                          missing=missing, waited_s=round(waited, 3))
                raise PartsMissing(step, missing, self.cfg.session, waited)
            if self._closed_within(poll):
                return None
            poll = next_backoff(poll, PARTS_POLL_MAX_S)

    def _poll_parts(self, step: int) -> dict[int, dict[str, FileEntry]] | CheckpointManifest:
        if (committed := self.durable.committed_manifest(step)) is not None:
            return committed
        return self.durable.parts(step, self.cfg.session, self.cfg.nnodes)

    def _retrying(self, step: int, call: Callable[[], T]) -> tuple[T, float] | None:
        """`call()` until the durable tier answers, with backoff and the outage events:
        (its value, seconds spent waiting out an outage); None once closing."""
        backoff, tries = self.cfg.retry_s, 0
        while True:
            try:
                value = call()
                break
            except StorageUnavailable as exc:
                tries += 1
                self._outage(step, exc, backoff)
                if self._closed_within(backoff):
                    return None
                backoff = next_backoff(backoff, self.cfg.retry_max_s)
        return value, self._recovered(step, tries)

    def _closed_within(self, seconds: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._closing, timeout=seconds)

    def _after_commit(self, step: int, man: CheckpointManifest) -> None:
        """Tell the parent at once (heartbeats), then retention and fast-tier cleanup. A
        part (node k > 0) is said as one — it is not a commit — and only node 0, which
        commits, applies retention."""
        if self.cfg.node_rank > 0:
            self.send(op="committed", step=step, part=True, node_rank=self.cfg.node_rank,
                      manifest=man.to_json(), uri=self.durable.uri(step))
        else:
            self.send(op="committed", step=step, manifest=man.to_json(),
                      uri=self.durable.uri(step))
            try:
                apply_retention(self.durable, self.retention, newest_verified=step)
            except StorageUnavailable as exc:  # retention is retried after the next commit
                log.warning("retention_deferred", step=step, error=exc.cause[:200])
        busy = self.in_flight()
        for old in self.fast.list_committed():  # the fast tier keeps the newest durable copy
            if old < step and old not in busy:
                self.fast.delete(old)

    def _outage(self, step: int, exc: StorageUnavailable, retry_in: float) -> None:
        if self._outage_since is None:
            self._outage_since, self._outage_ts = time.monotonic(), time.time()
            self.emit("durable_unavailable", step=step, uri=self.durable.url,
                      error=exc.cause[:300], retry_in_s=retry_in)
            self.fault(Fault(kind="storage_outage",
                             event_id=outage_fault_id(step, self._outage_ts),
                             detected_by="checkpoint_writer", fault_ts=self._outage_ts,
                             detected_ts=self._outage_ts, last_step=step,
                             evidence=f"durable store unavailable uploading step {step}: "
                                      f"{exc.cause[:300]}"))
        log.warning("checkpoint_upload_retry", step=step, error=exc.cause[:200],
                    retry_in_s=retry_in)

    def _recovered(self, step: int, tries: int) -> float:
        """The store answers again: say so once; the outage's seconds (0.0: there was none)."""
        if self._outage_since is None:
            return 0.0
        outage_s = round(time.monotonic() - self._outage_since, 2)
        self._outage_since = None
        self.emit("durable_recovered", step=step, flush=False, uri=self.durable.url,
                  outage_s=outage_s, failed_uploads=tries)
        fault = outage_fault_id(step, self._outage_ts)  # waited out: training went on
        self.emit("recovered", step=step, flush=True, event_id=f"recovered/{fault}",
                  fault_event_id=fault, resumed_step=None, lost_steps=0, detection_s=0.0,
                  restart_s=0.0, restore_s=0.0, mttr_s=outage_s, waited_out=True)
        return outage_s

    def _fail(self, step: int, stage: str, exc: BaseException) -> None:
        self.send(**failure_message(step, stage, exc))
        self.close()


def outage_fault_id(step: int, since: float) -> str:
    return f"fault/storage_outage/{step}/{since:.0f}"


@contextlib.contextmanager
def upload_span(job: _Job, run_id: str) -> Iterator[None]:
    """`upload <step>`: the durable commit, linked to the checkpoint stage that asked."""
    from opentelemetry import trace
    from opentelemetry.trace import Link
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    links = []
    if job.link:
        linked = trace.get_current_span(TraceContextTextMapPropagator().extract(
            {"traceparent": job.link})).get_span_context()
        links = [Link(linked)] if linked.is_valid else []
    # this thread has no context of its own: the parent is the process's TRACEPARENT
    parent = TraceContextTextMapPropagator().extract(
        {"traceparent": os.environ.get("TRACEPARENT", "")})
    with trace.get_tracer("mainspring").start_as_current_span(
            f"upload {job.step}", context=parent, links=links, attributes={
                "run_id": run_id, "step": job.step, "async": True,
                "bytes": job.manifest.total_bytes if job.manifest else 0}):
        yield


def protocol_stream() -> IO[str]:
    """Keep the original stdout for messages; anything else printed there goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def main(argv: list[str]) -> int:
    out = protocol_stream()
    from common.procs import set_parent_death_signal
    from common.telemetry import configure_logging

    cfg = WriterConfig.from_json(argv[0])
    set_parent_death_signal()
    if os.getppid() != cfg.parent_pid:  # the parent died before the signal was armed
        return 1
    # Before any thread starts: threads inherit it. With CONFIG_SCHED_AUTOGROUP nice ranks
    # the writer below the trainer inside their session's CPU group. A session of its own
    # (group nice 10) starved it under other sessions' load — uploads stalled and the loop
    # waited on backpressure (docs/decisions.md) — so it shares the trainer's group.
    os.nice(WRITER_NICE)
    if cfg.run_id:  # its upload spans, in the run's trace (TRACEPARENT) and store
        from common import telemetry
        from storage.spans import DurableSpanExporter

        telemetry.configure("checkpoint-writer", exporters=[
            DurableSpanExporter("checkpoint-writer", run=(cfg.durable_url, cfg.run_id))])
        telemetry.attach_parent_from_env()
    else:
        configure_logging()
    writer = Writer(cfg, out)
    threads = [threading.Thread(target=writer.fast_loop, name="ckpt-fast", daemon=True),
               threading.Thread(target=writer.upload_loop, name="ckpt-upload", daemon=True)]
    for thread in threads:
        thread.start()
    for line in sys.stdin:  # EOF: the parent closed the pipe or died
        writer.handle(json.loads(line))
        if writer._closing:
            break
    writer.close()
    for thread in threads:
        thread.join()
    from common.telemetry import flush

    flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
