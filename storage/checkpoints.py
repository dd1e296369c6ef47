"""Checkpoint store: `runs/<run_id>/checkpoints/step-<n>/` with MANIFEST.json as commit point.

DESIGN §3: a checkpoint exists only once its manifest is written, last, on the durable
tier. Readers ignore any directory without one. A manifest is never overwritten
(`storage.fs.put_new`: conditional PUT on S3, link() on disk). Loading verifies every
file's sha256 and size; a mismatch raises `CorruptCheckpoint`. Deletion removes the
manifest first, so a deletion cut short leaves only an invisible directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from ops.errors import MainspringError, StorageUnavailable
from storage.fs import (
    is_unavailable,
    join,
    put_new,
    resolve,
    sha256_file,
    sha256_stream,
    storage_errors,
    walk_files,
)

log = structlog.get_logger(__name__)

MANIFEST = "MANIFEST.json"
STEP_DIR = re.compile(r"^step-(\d{9})$")


class CorruptCheckpoint(MainspringError):
    def __init__(self, step: int, file: str, expected: str, actual: str) -> None:
        self.step, self.file, self.expected, self.actual = step, file, expected, actual
        super().__init__(f"checkpoint step {step}: {file} checksum {actual} != manifest {expected}")


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True, kw_only=True)
class CheckpointManifest:
    step: int
    files: dict[str, FileEntry]
    tokens_seen: int = 0
    data_cursor: int = 0
    skip_ranges: tuple[tuple[int, int], ...] = ()
    detector_state: str = ""  # file in `files` that holds the spike detector's state
    config_hash: str = ""
    parent: int | None = None
    writer: str = ""
    created: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CheckpointManifest:
        raw = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        raw = {k: v for k, v in raw.items() if k in known}  # newer writers may add fields
        raw["files"] = {k: FileEntry(**v) for k, v in raw["files"].items()}
        raw["skip_ranges"] = tuple(tuple(r) for r in raw.get("skip_ranges", ()))
        return cls(**raw)


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


def hash_dir(local_dir: str) -> dict[str, FileEntry]:
    """sha256 and size of every file under local_dir (hashlib releases the GIL per chunk)."""
    files = {}
    for rel in walk_files(local_dir):
        if rel == MANIFEST or os.path.basename(rel).startswith("."):
            continue
        with open(os.path.join(local_dir, rel), "rb") as f:
            digest, size = sha256_stream(f)
        files[rel] = FileEntry(size=size, sha256=digest)
    return files


class CheckpointStore:
    """Committed checkpoints of one run on one fsspec URL (durable tier, or a local fast tier)."""

    def __init__(self, durable_url: str, run_id: str) -> None:
        self.fs, root = resolve(durable_url)
        self.url = durable_url
        self.root = join(root, "runs", run_id, "checkpoints")

    @classmethod
    def at(cls, url: str, root: str | None = None) -> CheckpointStore:
        """A store whose step directories sit right under `root` (default: `url`'s path) —
        the fast tier, or a durable tier whose root was resolved elsewhere."""
        store = cls.__new__(cls)
        store.fs, path = resolve(url)
        store.url, store.root = url, path if root is None else root
        return store

    @classmethod
    def local(cls, directory: str) -> CheckpointStore:
        """A store whose step directories sit right under `directory` (the fast tier)."""
        return cls.at(directory)

    # ---- naming ---------------------------------------------------------------
    def path(self, step: int, name: str = "") -> str:
        return join(self.root, step_dir(step), name)

    def uri(self, step: int) -> str:
        return f"{self.fs.unstrip_protocol(self.path(step))}"

    def _unavailable(self, exc: BaseException) -> StorageUnavailable:
        return StorageUnavailable(self.url, repr(exc))

    # ---- reading --------------------------------------------------------------
    def _steps_under(self, root: str) -> list[int]:
        self.fs.invalidate_cache()
        if not self.fs.exists(root):
            return []
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(root, detail=False)]
        steps = [int(m.group(1)) for n in names if (m := STEP_DIR.match(n))]
        return sorted(s for s in steps if self.fs.exists(join(root, step_dir(s), MANIFEST)))

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
        with self.fs.open(self.path(step, MANIFEST), "r") as f:
            return CheckpointManifest.from_json(f.read())

    def verify(self, step: int) -> list[CorruptCheckpoint]:
        """Every file's problem (missing, wrong size, wrong hash); empty means intact."""
        problems = []
        for name, entry in self.manifest(step).files.items():
            path = self.path(step, name)
            if not self.fs.exists(path):
                problems.append(CorruptCheckpoint(step, name, entry.sha256, "missing"))
                continue
            digest, size = sha256_file(self.fs, path)
            if digest != entry.sha256 or size != entry.size:
                problems.append(CorruptCheckpoint(step, name, entry.sha256, digest))
        return problems

    def latest_verified(self, at_or_before: int | None = None,
                        on_corrupt: Callable[[CorruptCheckpoint], None] | None = None,
                        ) -> int | None:
        """Newest committed step whose every file verifies; corrupt ones are reported, skipped."""
        for step in reversed(self.list_committed()):
            if at_or_before is not None and step > at_or_before:
                continue
            problems = self.verify(step)
            if not problems:
                return step
            _report(problems[0], on_corrupt)
        return None

    def fetch(self, step: int, local_dir: str) -> CheckpointManifest:
        """Download a committed checkpoint into local_dir, verifying each file while copying."""
        man = self.manifest(step)
        for name, entry in man.files.items():
            dest = os.path.join(local_dir, name)
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
               **meta: Any) -> CheckpointManifest:
        """Upload every file under local_dir, then write MANIFEST.json last (the commit point).

        `files` (already hashed, e.g. by the fast tier) skips re-hashing. Idempotent: if the
        step is already committed — before we start, or by a racing writer whose conditional
        manifest put won — the existing manifest is returned untouched.
        """
        try:
            if self.fs.exists(self.path(step, MANIFEST)):
                log.info("checkpoint_already_committed", step=step)
                return self.manifest(step)
            files = files if files is not None else hash_dir(local_dir)
            for rel in files:
                dest = self.path(step, rel)
                self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(os.path.join(local_dir, rel), dest)
            man = CheckpointManifest(step=step, files=files, **meta)
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

    def commit_in_place(self, step: int, **meta: Any) -> CheckpointManifest:
        """Local tier: the files already sit at path(step); hash them and write the manifest."""
        man = CheckpointManifest(step=step, files=hash_dir(self.path(step)), **meta)
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
        for name, entry in man.files.items():
            dest = self.promoted_path(step, name)
            self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            self.fs.copy(self.path(step, name), dest)
            digest, size = sha256_file(self.fs, dest)
            if digest != entry.sha256 or size != entry.size:
                raise CorruptCheckpoint(step, f"promoted/{name}", entry.sha256, digest)
        try:
            put_new(self.fs, self.promoted_path(step, MANIFEST), man.to_json().encode())
        except FileExistsError:
            pass  # a racing retry promoted the same verified bytes
        log.info("checkpoint_promoted", step=step, uri=uri, bytes=man.total_bytes)
        return uri, man


def _report(exc: CorruptCheckpoint, on_corrupt: Callable[[CorruptCheckpoint], None] | None,
            ) -> None:
    log.warning("checkpoint_corrupt", step=exc.step, file=exc.file, expected=exc.expected,
                actual=exc.actual)
    if on_corrupt:
        on_corrupt(exc)
