"""What every trainer child process shares (segment, evaluate, export): reading its spec
file, atomic JSON writes, and the one classification path of its failures (error.json)."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import structlog

from common.errors import BadConfig, MainspringError, StorageUnavailable
from common.protocol import ErrorReport
from spec import RunSpec

log = structlog.get_logger(__name__)

EXIT_BAD_INPUT = 3  # BadConfig / BadData, error.json written: non-retryable
EXIT_STORAGE = 4  # StorageUnavailable, error.json written: retryable


def write_json(path: str, obj: Any, first_wins: bool = False) -> None:
    """Write `obj` (or a common/protocol.py record) as JSON, atomically; with `first_wins`,
    only when no other rank has written `path` yet (the root error, not what followed)."""
    tmp = f"{path}.{os.getpid()}.tmp"  # ranks may write the same file
    with open(tmp, "w") as f:
        f.write(obj.to_json() if hasattr(obj, "to_json") else json.dumps(obj))
    if not first_wins:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # fails when it exists: atomic first-writer-wins
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def run_classified(name: str, workdir: str, body: Callable[[], None]) -> int:
    """Run a child entry point's body; map failures to the supervisor's contract.

    A MainspringError -> error.json naming its kind and retryability, then exit 3 when it
    will repeat (BadConfig, BadData, Diverged, ...: not retried), 4 for StorageUnavailable,
    1 for other retryable ones; anything else -> error.json of its type and frame
    (crash_report), exit 1: retryable.
    """
    try:
        body()
    except MainspringError as exc:
        log.error("entry_point_failed", entry=name, kind=exc.kind, message=str(exc),
                  retryable=exc.retryable)
        write_json(os.path.join(workdir, "error.json"),
                   ErrorReport(type=exc.kind, message=str(exc), retryable=exc.retryable))
        if isinstance(exc, StorageUnavailable):
            return EXIT_STORAGE
        return 1 if exc.retryable else EXIT_BAD_INPUT
    except Exception as exc:  # a bug or an OOM: the supervisor classifies it (retryable)
        log.exception("entry_point_crashed", entry=name)
        # a peer's failure that follows this one (a reset connection) must not hide it
        write_json(os.path.join(workdir, "error.json"), crash_report(exc), first_wins=True)
        return 1
    return 0


def crash_report(exc: BaseException) -> ErrorReport:
    """error.json for an exception of no MainspringError class: its type (torch's CUDA OOM
    is `OutOfMemoryError`), message and innermost frame; retryable — the supervisor and the
    repeated-failure budget decide whether it is worth it."""
    tb = traceback.extract_tb(exc.__traceback__)
    frame = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name}" if tb else ""
    return ErrorReport(type=type(exc).__name__, message=str(exc)[:2000], retryable=True,
                       frame=frame)


def load_spec(path: str) -> RunSpec:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise BadConfig("--spec", f"cannot read {path}: {exc}", "pass a RunSpec JSON file") from None
    return RunSpec.from_dict(raw)
