"""What every trainer child process shares (segment, evaluate, export): reading its spec
file, atomic JSON writes, and the one classification path of its failures (error.json)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import structlog

from common.errors import BadConfig, MainspringError, StorageUnavailable
from common.protocol import ErrorReport
from spec import RunSpec

log = structlog.get_logger(__name__)

EXIT_BAD_INPUT = 3  # BadConfig / BadData, error.json written: non-retryable
EXIT_STORAGE = 4  # StorageUnavailable, error.json written: retryable


def write_json(path: str, obj: Any) -> None:
    """Write `obj` (or a common/protocol.py record) as JSON, atomically."""
    tmp = f"{path}.{os.getpid()}.tmp"  # ranks may write the same file
    with open(tmp, "w") as f:
        f.write(obj.to_json() if hasattr(obj, "to_json") else json.dumps(obj))
    os.replace(tmp, path)


def run_classified(name: str, workdir: str, body: Callable[[], None]) -> int:
    """Run a child entry point's body; map failures to the supervisor's contract.

    A MainspringError -> error.json naming its kind and retryability, then exit 3 when it
    will repeat (BadConfig, BadData, Diverged, ...: not retried), 4 for StorageUnavailable,
    1 for other retryable ones; anything else -> exit 1 (a retryable HardwareFault).
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
    except Exception:  # logged; the supervisor classifies the exit code
        log.exception("entry_point_crashed", entry=name)
        return 1
    return 0


def load_spec(path: str) -> RunSpec:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise BadConfig("--spec", f"cannot read {path}: {exc}", "pass a RunSpec JSON file") from None
    return RunSpec.from_dict(raw)
