"""Checkpoint store: `runs/<run_id>/checkpoints/step-<n>/` with MANIFEST.json as commit point.

DESIGN §3: a checkpoint exists only once its manifest is written, last, on the durable
tier. Readers ignore any directory without one. A manifest is never overwritten
(`storage.fs.put_new`: conditional PUT on S3, link() on disk). Loading verifies every
file's sha256 and size; a mismatch raises `CorruptCheckpoint`. Deletion removes the
manifest first, so a deletion cut short leaves only an invisible directory.

A malformed manifest, or one naming a file outside `FILE_PATTERNS` (storage/manifest.py,
re-exported here), is a `CorruptCheckpoint` on MANIFEST.json, so readers fall back past it as
past a bad data file (docs/decisions.md). Commits are crash-safe on disk (temporary name,
fsync, rename, directory fsync) and never replace a data file of a step whose manifest
exists.

Multi-node segments: each node holds only its own ranks' files on its fast tier. A node
other than 0 puts them on the durable tier and then its part record
(`step-N/parts/node-<k>.json`, `commit_part`); node 0 waits for every part of this launch
(`parts`, matched by `session`) and commits once, listing every rank's files
(`commit(..., remote=...)`). A part is not a commit: no reader looks at one, and a part
left by an earlier, failed launch of the step carries another session and is ignored.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from common.errors import BadData, StorageUnavailable
from common.faults import Fault, record_fault
from common.store_json import load_record
from storage.fs import (
    commit_lock,
    copy_durable,
    is_unavailable,
    join,
    pipe_durable,
    put_file_durable,
    put_new,
    resolve,
    sha256_file,
    sha256_stream,
    storage_errors,
)
from storage.manifest import (
    FILE_PATTERNS,
    MANIFEST,
    PARTS,
    STEP_DIR,
    CheckpointManifest,
    CorruptCheckpoint,
    FileEntry,
    check_file_names,
    file_name_problem,
    hash_dir,
    manifest_problem,
    step_dir,
    step_of_dir,
)

__all__ = ["FILE_PATTERNS", "MANIFEST", "PARTS", "STEP_DIR", "CheckpointManifest",
           "CheckpointStore", "CorruptCheckpoint", "FileEntry", "NodePart", "check_file_names",
           "emit_corrupt", "file_name_problem", "hash_dir", "manifest_problem", "part_problem",
           "step_dir", "step_of_dir", "union_files"]

log = structlog.get_logger(__name__)

LIST_TRIES = 5  # listings of a checkpoint root taken again after racing a delete

class CheckpointStore:
    """Committed checkpoints of one run on one fsspec URL (durable tier, or a local fast tier)."""

    def __init__(self, durable_url: str, run_id: str) -> None:
        self.fs, root = resolve(durable_url)
        self.url, self.run_id = durable_url, run_id
        self.root = join(root, "runs", run_id, "checkpoints")

    @classmethod
    def at(cls, url: str, root: str | None = None) -> CheckpointStore:
        """A store whose step directories sit right under `root` (default: `url`'s path) —
        the fast tier, or a durable tier whose root was resolved elsewhere."""
        store = cls.__new__(cls)
        store.fs, path = resolve(url)
        store.url, store.root = url, path if root is None else root
        store.run_id = ""
        return store

    @classmethod
    def local(cls, directory: str) -> CheckpointStore:
        """A store whose step directories sit right under `directory` (the fast tier)."""
        return cls.at(directory)

    # ---- naming ---------------------------------------------------------------
    def path(self, step: int, name: str = "") -> str:
        return join(self.root, step_dir(step), name)

    def part_path(self, step: int, node_rank: int) -> str:
        """Node `node_rank`'s part record of a multi-node step: inside the step's directory,
        so deleting the step removes it; under `parts/`, which no manifest may name."""
        return self.path(step, f"{PARTS}/node-{node_rank}.json")

    def uri(self, step: int) -> str:
        return f"{self.fs.unstrip_protocol(self.path(step))}"

    def _unavailable(self, exc: BaseException) -> StorageUnavailable:
        return StorageUnavailable(self.url, repr(exc))

    # ---- reading --------------------------------------------------------------
    def _steps_under(self, root: str) -> list[int]:
        """Steps with a MANIFEST.json directly under `root`, from one flat listing of the
        keys that start with `step-` (on S3 a paginated LIST of that prefix, 1,000 keys a
        request; a resume and a segment's end read this on the restart path, where seconds count).
        A glob of `step-*/MANIFEST.json` walked the prefix instead, one LIST per step
        directory: a restore 389 checkpoints into the 40-minute goodput soak took 7.6 s,
        growing with the run.

        Retention deletes old steps while others list (another launch's writer, the
        checkpointer's own cleanup): a walk that finds a step directory gone between its
        listing and its look inside raises FileNotFoundError — seen in benchmarks/
        recovery.py as a rank crashing on its first step. The listing is then taken again."""
        base = self.fs._strip_protocol(root).rstrip("/") + "/"
        for tries_left in reversed(range(LIST_TRIES)):
            self.fs.invalidate_cache()
            try:
                found = self.fs.find(root, prefix="step-")
                break
            except FileNotFoundError:
                if not tries_left:
                    raise
                log.info("checkpoint_listing_raced_a_delete", root=root)
        steps = set()
        for path in found:  # step-<n>/MANIFEST.json exactly, not a part record below it
            parts = path[len(base):].split("/") if path.startswith(base) else []
            step = step_of_dir(parts[0]) if len(parts) == 2 and parts[1] == MANIFEST else None
            if step is not None:
                steps.add(step)
        return sorted(steps)

    def list_committed(self) -> list[int]:
        """Steps whose MANIFEST.json exists, ascending. Uncommitted directories are ignored."""
        try:
            return self._steps_under(self.root)
        except storage_errors() as exc:
            raise self._unavailable(exc) from exc

    def list_promoted(self) -> list[int]:
        try:
            return self._steps_under(self.promoted_path(0).rsplit("/", 1)[0])
        except storage_errors() as exc:
            raise self._unavailable(exc) from exc

    def latest_committed(self, at_or_before: int | None = None) -> int | None:
        steps = [s for s in self.list_committed() if at_or_before is None or s <= at_or_before]
        return steps[-1] if steps else None

    def manifest(self, step: int) -> CheckpointManifest:
        """The checked manifest of a committed step; CorruptCheckpoint if it is malformed."""
        with self.fs.open(self.path(step, MANIFEST), "rb") as f:
            return CheckpointManifest.from_json(f.read(), step=step)

    def committed_manifest(self, step: int) -> CheckpointManifest | None:
        """The step's manifest if it exists and reads; None if it is absent or corrupt (every
        reader skips a corrupt one, and the next commit of the step replaces it). Unlike
        commit's own check this changes nothing."""
        try:
            return self.manifest(step)
        except (FileNotFoundError, CorruptCheckpoint):
            return None
        except Exception as exc:
            if is_unavailable(exc):
                raise self._unavailable(exc) from exc
            raise

    def parts(self, step: int, session: str, nnodes: int) -> dict[int, dict[str, FileEntry]]:
        """The files of nodes 1..nnodes-1 that wrote their part of `step` in launch `session`.
        A part of another session (an earlier, failed launch of the step) or a malformed one
        is left out, so node 0 waits on as if it were missing."""
        found: dict[int, dict[str, FileEntry]] = {}
        for node in range(1, nnodes):
            try:
                with self.fs.open(self.part_path(step, node), "rb") as f:
                    text = f.read()
            except FileNotFoundError:
                continue
            except Exception as exc:
                if is_unavailable(exc):
                    raise self._unavailable(exc) from exc
                raise
            try:
                part = NodePart.from_json(text, step=step, node_rank=node)
            except ValueError as exc:
                log.warning("checkpoint_part_malformed", step=step, node_rank=node,
                            problem=str(exc)[:200])
                continue
            if part.session != session:
                log.debug("checkpoint_part_stale", step=step, node_rank=node,  # a log key
                          launch=part.session, this_launch=session)  # "session" is masked
                continue
            found[node] = part.files
        return found

    def verify(self, step: int) -> list[CorruptCheckpoint]:
        """Every file's problem (missing, wrong size, wrong hash) — or the manifest's own,
        alone; empty means intact."""
        try:
            man = self.manifest(step)
        except CorruptCheckpoint as exc:
            return [exc]
        problems = []
        for name, entry in man.files.items():
            path = self.path(step, name)
            if not self.fs.exists(path):
                problems.append(CorruptCheckpoint(step, name, entry.sha256, "missing"))
                continue
            digest, size = sha256_file(self.fs, path)
            if digest != entry.sha256 or size != entry.size:
                problems.append(CorruptCheckpoint(step, name, entry.sha256, digest))
        return problems

    def fetch(self, step: int, local_dir: str) -> CheckpointManifest:
        """Download a committed checkpoint into local_dir, verifying each file while copying."""
        man = self.manifest(step)  # every name checked before any I/O below
        for name, entry in man.files.items():
            dest = _inside(local_dir, name, step)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            try:
                with self.fs.open(self.path(step, name), "rb") as src, \
                        open(dest + ".part", "wb") as out:
                    digest, size = sha256_stream(src, copy_to=out)
            except FileNotFoundError:
                raise CorruptCheckpoint(step, name, entry.sha256, "missing") from None
            if digest != entry.sha256 or size != entry.size:
                os.unlink(dest + ".part")
                raise CorruptCheckpoint(step, name, entry.sha256, digest)
            os.replace(dest + ".part", dest)
        return man

    load = fetch  # the name: load(step) into a local directory, verified

    def fetch_latest(self, local_dir: str, at_or_before: int | None = None,
                     on_corrupt: Callable[[CorruptCheckpoint], None] | None = None,
                     ) -> CheckpointManifest | None:
        """Newest committed checkpoint that verifies; corrupt ones are reported and skipped."""
        for step in reversed(self.list_committed()):
            if at_or_before is not None and step > at_or_before:
                continue
            try:
                return self.fetch(step, os.path.join(local_dir, step_dir(step)))
            except CorruptCheckpoint as exc:
                _report(exc, on_corrupt)
        return None

    # ---- writing --------------------------------------------------------------
    def commit(self, step: int, local_dir: str, *, files: dict[str, FileEntry] | None = None,
               remote: dict[str, FileEntry] | None = None, **meta: Any) -> CheckpointManifest:
        """Upload every file under local_dir, then write MANIFEST.json last (the commit point).

        `files` (already hashed, e.g. by the fast tier) skips re-hashing. `remote`: files
        already on the durable tier (other nodes' parts), listed in the manifest but not
        uploaded; a name in both must have the same entry (BadData otherwise). Idempotent,
        and a no-op for a second writer: if the step is committed — before we start, between
        two of our uploads, or by a racing writer whose conditional manifest put won — the
        existing manifest is returned and none of its data files is replaced (module doc).
        """
        remote = remote or {}
        try:
            with commit_lock(self.fs, self.path(step)):
                if (existing := self._existing(step)) is not None:
                    return existing
                files = files if files is not None else hash_dir(local_dir)
                check_file_names(step, local_dir, files)
                check_file_names(step, self.path(step), remote)
                listed = union_files(step, self.path(step), files, remote)
                for rel in files:
                    if rel in remote:  # the same bytes are on the durable tier already
                        continue
                    if (existing := self._existing(step)) is not None:  # S3: per-file window
                        return existing
                    put_file_durable(self.fs, os.path.join(local_dir, rel), self.path(step, rel))
                man = CheckpointManifest(step=step, files=listed, **meta)
                put_new(self.fs, self.path(step, MANIFEST), man.to_json().encode())
        except FileExistsError:
            log.warning("checkpoint_commit_lost_race", step=step)
            return self.manifest(step)
        except Exception as exc:
            if is_unavailable(exc):
                raise self._unavailable(exc) from exc
            raise
        log.info("checkpoint_committed", step=step, uri=self.uri(step), bytes=man.total_bytes)
        return man

    def _existing(self, step: int) -> CheckpointManifest | None:
        """The step's committed manifest; None if there is none — or if it is corrupt: every
        reader skips that step already, so it is uncommitted here and this commit replaces
        it (else a replay of the step would fail on it at every retry)."""
        if not self.fs.exists(self.path(step, MANIFEST)):
            return None
        try:
            man = self.manifest(step)
        except CorruptCheckpoint as exc:
            _report(exc, None)
            log.warning("checkpoint_corrupt_manifest_replaced", step=step)
            self.fs.rm_file(self.path(step, MANIFEST))
            return None
        log.info("checkpoint_already_committed", step=step)
        return man

    def commit_part(self, step: int, local_dir: str, *, files: dict[str, FileEntry],
                    node_rank: int, session: str) -> bool:
        """Node `node_rank` (> 0) of a multi-node step: its files onto the durable tier, then
        its part record, last — what node 0 waits for before it writes the one manifest.

        True once the part is written. False, and nothing (more) written, when the step is
        committed — before we start or between two uploads (a retry of a committed step):
        a committed step's data files are never replaced. Under the step's commit lock like
        `commit` (node 0 takes it only once every part is there, so neither waits for the
        other). The part is overwritten plainly: it is not a commit, and only its session's
        node 0 reads it.
        """
        if node_rank < 1:
            raise ValueError(f"node {node_rank} commits the step; parts come from nodes >= 1")
        check_file_names(step, local_dir, files)
        part = NodePart(step=step, node_rank=node_rank, session=session, files=files)
        try:
            with commit_lock(self.fs, self.path(step)):
                for rel in [*files, None]:  # None: the last check, before the part itself
                    if self.committed_manifest(step) is not None:
                        log.info("checkpoint_part_skipped", step=step, node_rank=node_rank,
                                 reason="already committed")
                        return False
                    if rel is not None:
                        put_file_durable(self.fs, os.path.join(local_dir, rel),
                                         self.path(step, rel))
                pipe_durable(self.fs, self.part_path(step, node_rank), part.to_json().encode())
        except Exception as exc:
            if is_unavailable(exc):
                raise self._unavailable(exc) from exc
            raise
        log.info("checkpoint_part_written", step=step, node_rank=node_rank, launch=session,
                 files=len(files), bytes=sum(f.size for f in files.values()))
        return True

    def commit_in_place(self, step: int, **meta: Any) -> CheckpointManifest:
        """Local tier: the files already sit at path(step); hash them and write the manifest.
        The data files are not fsynced (DeepSpeed wrote them): a resume hashes a fast-tier
        copy before using it, so a torn one is found and skipped, never loaded."""
        files = hash_dir(self.path(step))
        check_file_names(step, self.path(step), files)
        man = CheckpointManifest(step=step, files=files, **meta)
        put_new(self.fs, self.path(step, MANIFEST), man.to_json().encode())
        return man

    def delete(self, step: int) -> None:
        """Uncommit (manifest first), then remove the files; safe to cut short at any point."""
        try:
            if self.fs.exists(self.path(step, MANIFEST)):
                self.fs.rm_file(self.path(step, MANIFEST))
            if self.fs.exists(self.path(step)):
                self.fs.rm(self.path(step), recursive=True)
        except storage_errors() as exc:
            raise self._unavailable(exc) from exc
        log.info("checkpoint_deleted", step=step, uri=self.uri(step))

    # ---- promotion ------------------------------------------------------------
    def promoted_path(self, step: int, name: str = "") -> str:
        return join(self.root.rsplit("/", 1)[0], "promoted", step_dir(step), name)

    def promote(self, step: int) -> tuple[str, CheckpointManifest]:
        """Copy a committed checkpoint to promoted/, verify every copy, manifest last."""
        problems = self.verify(step)
        if problems:
            raise problems[0]
        man = self.manifest(step)
        uri = self.fs.unstrip_protocol(self.promoted_path(step))
        if self.fs.exists(self.promoted_path(step, MANIFEST)):
            return uri, man  # an activity retry after the promotion committed
        for name, entry in man.files.items():  # names checked by manifest(), via verify()
            dest = self.promoted_path(step, name)
            self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            copy_durable(self.fs, self.path(step, name), dest)
            digest, size = sha256_file(self.fs, dest)
            if digest != entry.sha256 or size != entry.size:
                raise CorruptCheckpoint(step, f"promoted/{name}", entry.sha256, digest)
        try:
            put_new(self.fs, self.promoted_path(step, MANIFEST), man.to_json().encode())
        except FileExistsError:
            pass  # a racing retry promoted the same verified bytes
        log.info("checkpoint_promoted", step=step, uri=uri, bytes=man.total_bytes)
        return uri, man


@dataclass(frozen=True, kw_only=True)
class NodePart:
    """One node's share of a multi-node step on the durable tier: its files (already put
    there) and the launch (`session`) that wrote them."""

    step: int
    node_rank: int
    session: str
    files: dict[str, FileEntry]
    created: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, *, step: int, node_rank: int) -> NodePart:
        """Parse and check the part at part_path(step, node_rank); ValueError saying why not."""
        raw = load_record(text, f"part of node {node_rank}")  # StoreRecordInvalid: a ValueError
        if problem := part_problem(raw, step=step, node_rank=node_rank):
            raise ValueError(problem)
        return cls(step=step, node_rank=node_rank, session=raw["session"],
                   created=raw["created"], files={
                       k: FileEntry(size=v["size"], sha256=v["sha256"])
                       for k, v in raw["files"].items()})


def part_problem(raw: object, *, step: int, node_rank: int) -> str | None:
    """Why a parsed part record cannot be merged (None: it can). Pure; its files are held to
    a manifest's rules, since they end up in one."""
    if not isinstance(raw, dict):
        return "not a JSON object"
    if not (type(raw.get("step")) is int and type(raw.get("node_rank")) is int
            and raw["step"] == step and raw["node_rank"] == node_rank):
        return (f"says step {raw.get('step')!r:.20} node {raw.get('node_rank')!r:.20}, "
                f"not step {step} node {node_rank}")
    if not isinstance(raw.get("session"), str):
        return "session is not a string"
    created = raw.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        return "created is not a number"
    return manifest_problem({"step": step, "files": raw.get("files")})


def union_files(step: int, where: str, *sets: dict[str, FileEntry]) -> dict[str, FileEntry]:
    """Every file of `sets` (one node's files each) as one manifest's list; a name listed
    twice must be the same bytes, else BadData naming it — one manifest cannot hold both,
    and picking one would leave some rank loading the other's."""
    merged: dict[str, FileEntry] = {}
    for files in sets:
        for name, entry in files.items():
            if merged.setdefault(name, entry) != entry:
                raise BadData(join(where, name), f"checkpoint step {step}: {name} comes with two "
                              f"different contents ({merged[name].size} bytes, sha256 "
                              f"{merged[name].sha256[:12]}…; {entry.size} bytes, sha256 "
                              f"{entry.sha256[:12]}…)",
                              "each file of a checkpoint is written by one node; check that "
                              "every node saves only its own ranks' files")
    return merged


def _inside(local_dir: str, name: str, step: int) -> str:
    """local_dir/name, refused unless it stays inside local_dir (a second guard behind the
    manifest's name check: no manifest may make fetch write anywhere else)."""
    root = os.path.realpath(local_dir)
    dest = os.path.realpath(os.path.join(root, name))
    if file_name_problem(name) or os.path.commonpath([root, dest]) != root:
        raise CorruptCheckpoint(step, MANIFEST, "a relative file name", repr(name[:80]))
    return dest


def corrupt_fault_id(step: int) -> str:
    return f"fault/checkpoint_corrupt/{step}"


def emit_corrupt(events, exc: CorruptCheckpoint, detected_by: str = "trainer") -> None:
    """The `checkpoint_corrupt` event of `exc` into an EventLog (one id per step and file,
    so every reader that finds the same damage records it once), and the `fault` it is (one
    per step: common/fault_kinds.py), found by a restore or by the scrub (storage/scrub.py)."""
    events.emit("checkpoint_corrupt", step=exc.step, file=exc.file,
                event_id=f"checkpoint_corrupt/{exc.step}/{exc.file}",
                expected=exc.expected, actual=exc.actual)
    now = time.time()  # found when read: the damage's own time is unknown
    record_fault(events, Fault(kind="checkpoint_corrupt", event_id=corrupt_fault_id(exc.step),
                               detected_by=detected_by, fault_ts=now, detected_ts=now,
                               last_step=exc.step,
                               evidence=f"{exc.file}: expected {exc.expected}, "
                                        f"found {exc.actual}"))


def _report(exc: CorruptCheckpoint, on_corrupt: Callable[[CorruptCheckpoint], None] | None,
            ) -> None:
    log.warning("checkpoint_corrupt", step=exc.step, file=exc.file, expected=exc.expected,
                actual=exc.actual)
    if on_corrupt:
        on_corrupt(exc)
