"""Checkpoint store: `runs/<run_id>/checkpoints/step-<n>/` with MANIFEST.json as commit point.

DESIGN §3: a checkpoint exists only once its manifest is written, last, on the durable
tier. Readers ignore any directory without one. A manifest is never overwritten. Loading
verifies every file's sha256 and size; a mismatch raises `CorruptCheckpoint`.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import structlog

from ops.errors import MainspringError, StorageUnavailable
from storage.fs import join, resolve, sha256_file, sha256_stream, storage_errors, walk_files

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
    def from_json(cls, text: str) -> "CheckpointManifest":
        raw = json.loads(text)
        raw["files"] = {k: FileEntry(**v) for k, v in raw["files"].items()}
        raw["skip_ranges"] = tuple(tuple(r) for r in raw.get("skip_ranges", ()))
        return cls(**raw)


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


class CheckpointStore:
    """Committed checkpoints of one run on one fsspec URL (the durable tier)."""

    def __init__(self, durable_url: str, run_id: str) -> None:
        self.fs, root = resolve(durable_url)
        self.url = durable_url
        self.root = join(root, "runs", run_id, "checkpoints")

    # ---- naming ---------------------------------------------------------------
    def path(self, step: int, name: str = "") -> str:
        return join(self.root, step_dir(step), name)

    def uri(self, step: int) -> str:
        return f"{self.fs.unstrip_protocol(self.path(step))}"

    # ---- reading --------------------------------------------------------------
    def list_committed(self) -> list[int]:
        """Steps whose MANIFEST.json exists, ascending. Uncommitted directories are ignored."""
        try:
            self.fs.invalidate_cache()
            if not self.fs.exists(self.root):
                return []
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
            steps = [int(m.group(1)) for n in names if (m := STEP_DIR.match(n))]
            return sorted(s for s in steps if self.fs.exists(self.path(s, MANIFEST)))
        except storage_errors() as exc:
            raise StorageUnavailable(self.url, repr(exc)) from exc

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

    def fetch(self, step: int, local_dir: str) -> CheckpointManifest:
        """Download a committed checkpoint into local_dir, verifying each file while copying."""
        man = self.manifest(step)
        for name, entry in man.files.items():
            dest = os.path.join(local_dir, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with self.fs.open(self.path(step, name), "rb") as src, open(dest + ".part", "wb") as out:
                digest, size = sha256_stream(src, copy_to=out)
            if digest != entry.sha256 or size != entry.size:
                os.unlink(dest + ".part")
                raise CorruptCheckpoint(step, name, entry.sha256, digest)
            os.replace(dest + ".part", dest)
        return man

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
                log.warning("checkpoint_corrupt", step=step, file=exc.file,
                            expected=exc.expected, actual=exc.actual)
                if on_corrupt:
                    on_corrupt(exc)
        return None

    # ---- writing --------------------------------------------------------------
    def commit(self, step: int, local_dir: str, **meta: Any) -> CheckpointManifest:
        """Upload every file under local_dir, then write MANIFEST.json last (the commit point).

        Idempotent: if step is already committed, the existing manifest is returned untouched.
        """
        if self.fs.exists(self.path(step, MANIFEST)):
            log.info("checkpoint_already_committed", step=step)
            return self.manifest(step)
        files: dict[str, FileEntry] = {}
        try:
            for rel in walk_files(local_dir):
                with open(os.path.join(local_dir, rel), "rb") as f:
                    digest, size = sha256_stream(f)
                dest = self.path(step, rel)
                self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(os.path.join(local_dir, rel), dest)
                files[rel] = FileEntry(size=size, sha256=digest)
            man = CheckpointManifest(step=step, files=files, **meta)
            self.fs.makedirs(self.path(step), exist_ok=True)
            with self.fs.open(self.path(step, MANIFEST), "w") as f:
                f.write(man.to_json())
        except storage_errors() as exc:
            raise StorageUnavailable(self.url, repr(exc)) from exc
        log.info("checkpoint_committed", step=step, uri=self.uri(step), bytes=man.total_bytes)
        return man


    # ---- promotion ------------------------------------------------------------
    def promoted_path(self, step: int, name: str = "") -> str:
        return join(self.root.rsplit("/", 1)[0], "promoted", step_dir(step), name)

    def promote(self, step: int) -> tuple[str, CheckpointManifest]:
        """Copy a committed checkpoint to promoted/, verify every copy, manifest last."""
        problems = self.verify(step)
        if problems:
            raise problems[0]
        man = self.manifest(step)
        for name, entry in man.files.items():
            dest = self.promoted_path(step, name)
            self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            self.fs.copy(self.path(step, name), dest)
            digest, size = sha256_file(self.fs, dest)
            if digest != entry.sha256 or size != entry.size:
                raise CorruptCheckpoint(step, f"promoted/{name}", entry.sha256, digest)
        with self.fs.open(self.promoted_path(step, MANIFEST), "w") as f:
            f.write(man.to_json())
        uri = self.fs.unstrip_protocol(self.promoted_path(step))
        log.info("checkpoint_promoted", step=step, uri=uri, bytes=man.total_bytes)
        return uri, man
