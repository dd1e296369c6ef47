"""Checkpoint manifests: the commit point's content and the rules a reader holds it to.

A manifest names every file of a checkpoint with its size and sha256, plus the training
facts a resume needs (step, tokens, data cursor, skip ranges, detector state, config hash,
parent). `CheckpointManifest.from_json` refuses anything malformed — bad JSON, missing or
mistyped fields, a step other than its directory's, a file name outside `FILE_PATTERNS` —
as a `CorruptCheckpoint` on MANIFEST.json, so every reader falls back past it as past a
bad data file. The store that writes and reads them is storage/checkpoints.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from common.errors import BadData, MainspringError
from common.limits import MAX_STEP
from common.store_json import StoreRecordInvalid, load_record
from storage.fs import sha256_stream, walk_files

MANIFEST = "MANIFEST.json"
# A multi-node step's per-node records (storage/checkpoints.py:part_path) sit in this
# subdirectory of the step's durable directory, so deleting the step removes them. They are
# bookkeeping, never checkpoint files: hash_dir skips them and no pattern below admits them.
PARTS = "parts"
# A step's directory: `step-%09d` (step_dir), nine digits zero-padded - the name of every
# checkpoint committed so far - and unpadded from step 10^9 on, up to MAX_STEP's digits. No
# other spelling (a padded ten-digit name, a non-ASCII digit) is a writer's, so none is read.
STEP_DIGITS = len(str(MAX_STEP))
STEP_DIR = re.compile(rf"step-([0-9]{{9}}|[1-9][0-9]{{9,{STEP_DIGITS - 1}}})", re.ASCII)

# Every file name a checkpoint may hold: what DeepSpeed 0.19's save_checkpoint writes into
# a tag directory for ZeRO 0-3 without expert parallelism (checked against real saves,
# tests/trainer/test_safe_load.py; a pipeline's layer files against its saves,
# tests/trainer/test_pipeline_parallel.py), plus trainer/state.py:state_file. One flat
# directory: no pattern has a "/", so a name is relative and has no ".." by construction.
FILE_PATTERNS = tuple(re.compile(p, re.ASCII) for p in (
    r"mp_rank_[0-9]{2,}_model_states\.pt",  # weights (and, at ZeRO 0, the optimizer)
    r"zero_pp_rank_[0-9]+_mp_rank_[0-9]{2,}_model_states\.pt",  # ZeRO-3 weight partitions
    r"(bf16_)?zero_pp_rank_[0-9]+_mp_rank_[0-9]{2,}_optim_states\.pt",  # ZeRO 1-3 shards
    r"train_state-rank[0-9]+\.pt",  # the TrainState of each rank
    r"layer_[0-9]{2,}-model_states\.pt",  # a pipeline's weights, one file per layer
))
SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)


class CorruptCheckpoint(MainspringError):
    """A committed checkpoint that cannot be used: a data file that is missing or differs
    from its manifest entry, or a manifest that is malformed (`file` is then MANIFEST.json)."""

    def __init__(self, step: int, file: str, expected: str, actual: str) -> None:
        self.step, self.file, self.expected, self.actual = step, file, expected, actual
        super().__init__(f"checkpoint step {step}: {file}: expected {expected}, found {actual}")


def file_name_problem(name: object) -> str | None:
    """Why `name` may not be a checkpoint file (None: it may). The structural checks come
    first so the reason says what is wrong; the allow-list alone would refuse them too."""
    if not isinstance(name, str) or not name:
        return f"file name {name!r} is not a non-empty string"
    shown = repr(name[:80])
    if "\x00" in name or "\\" in name:
        return f"file name {shown} holds a NUL or a backslash"
    if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        return f"file name {shown} is absolute or has an empty, '.' or '..' component"
    if name == MANIFEST or not any(p.fullmatch(name) for p in FILE_PATTERNS):
        return f"file name {shown} is not one the trainer writes"
    return None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_pairs(v: object) -> bool:
    return isinstance(v, list) and all(
        isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) for r in v)


# The optional fields' types (CheckpointManifest); a missing one takes its default.
FIELD_CHECKS: dict[str, Callable[[object], bool]] = {
    "tokens_seen": _is_int, "data_cursor": _is_int, "skip_ranges": _is_pairs,
    "detector_state": lambda v: isinstance(v, str), "config_hash": lambda v: isinstance(v, str),
    "writer": lambda v: isinstance(v, str), "parent": lambda v: v is None or _is_int(v),
    "created": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "extra": lambda v: isinstance(v, dict),
}


def manifest_problem(raw: object) -> str | None:
    """Why a parsed MANIFEST.json cannot be used (None: it can). Pure; unknown keys are
    allowed (newer writers may add fields)."""
    if not isinstance(raw, dict):
        return "not a JSON object"
    if not _is_int(raw.get("step")):
        return f"step {raw.get('step')!r:.40} is not an integer >= 0"
    if not isinstance(raw.get("files"), dict):
        return "files is not an object"
    for name, entry in raw["files"].items():
        if problem := file_name_problem(name):
            return problem
        if not (isinstance(entry, dict) and _is_int(entry.get("size"))
                and isinstance(entry.get("sha256"), str) and SHA256.fullmatch(entry["sha256"])):
            return f"entry of {name!r} is not {{size: int >= 0, sha256: 64 hex digits}}"
    wrong = [k for k, ok in FIELD_CHECKS.items() if k in raw and not ok(raw[k])]
    return f"{wrong[0]} {raw[wrong[0]]!r:.40} has the wrong type" if wrong else None


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
    def from_json(cls, text: str | bytes, *, step: int | None = None) -> CheckpointManifest:
        """Parse and check a manifest (of directory `step`, when given); anything malformed
        raises CorruptCheckpoint(step, MANIFEST.json, "a valid manifest", reason)."""
        try:
            raw = load_record(text, MANIFEST)
        except StoreRecordInvalid as exc:  # not JSON or UTF-8, too deep, not finite, ...
            raise _bad_manifest(step, None, exc.problem[:120]) from None
        problem = manifest_problem(raw)
        if problem is None and step is not None and raw["step"] != step:
            problem = f"manifest says step {raw['step']}"
        if problem:
            raise _bad_manifest(step, raw, problem)
        known = {f.name for f in dataclasses.fields(cls)}
        raw = {k: v for k, v in raw.items() if k in known}  # newer writers may add fields
        raw["files"] = {k: FileEntry(size=v["size"], sha256=v["sha256"])
                        for k, v in raw["files"].items()}
        raw["skip_ranges"] = tuple(tuple(r) for r in raw.get("skip_ranges", ()))
        return cls(**raw)


def _bad_manifest(step: int | None, raw: object, reason: str) -> CorruptCheckpoint:
    """Of directory `step`, else of the step the manifest names (-1 if it names none)."""
    if step is None:
        named = raw.get("step") if isinstance(raw, dict) else None
        step = named if _is_int(named) else -1
    return CorruptCheckpoint(step, MANIFEST, "a valid manifest", reason)


def check_file_names(step: int, local_dir: str, names: Iterable[str]) -> None:
    """Writer side of the allow-list: refuse to commit a file no reader would accept."""
    for name in names:
        if problem := file_name_problem(name):
            raise BadData(os.path.join(local_dir, str(name)), f"checkpoint step {step}: {problem}",
                          "only DeepSpeed's and the TrainState's files belong in a checkpoint "
                          "directory; extend storage/manifest.py:FILE_PATTERNS for a new one")


def step_dir(step: int) -> str:
    """The directory name of `step`; every step in [0, MAX_STEP] has one (step_of_dir)."""
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step {step} is outside [0, MAX_STEP={MAX_STEP}] (common/limits.py)")
    return f"step-{step:09d}"


def step_of_dir(name: str) -> int | None:
    """The step whose directory `name` is (the inverse of step_dir), else None."""
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m and int(m.group(1)) <= MAX_STEP else None


def hash_dir(local_dir: str) -> dict[str, FileEntry]:
    """sha256 and size of every file under local_dir (hashlib releases the GIL per chunk).
    Skipped: the manifest, dot-files (temporaries, the commit lock) and `parts/` (node
    records), none of which is checkpoint data."""
    files = {}
    for rel in walk_files(local_dir):
        if (rel == MANIFEST or os.path.basename(rel).startswith(".")
                or rel.split(os.sep, 1)[0] == PARTS):
            continue
        with open(os.path.join(local_dir, rel), "rb") as f:
            digest, size = sha256_stream(f)
        files[rel] = FileEntry(size=size, sha256=digest)
    return files
