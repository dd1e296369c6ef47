"""Child-process supervision for trainer activities (DESIGN §1, §5).

The worker never trains in its own interpreter: it launches a child in its own process
group with a parent-death signal (no orphan keeps a GPU when the worker dies), tails the
child's progress file, heartbeats, detects hangs, and turns the child's exit into a
classified outcome: 0 = done; an error.json written by the child names the class
(BadConfig/BadData non-retryable, StorageUnavailable retryable); anything else is a
retryable HardwareFault.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from typing import Callable

import structlog
from temporalio.exceptions import ApplicationError, CancelledError

from common.errors import NON_RETRYABLE, HardwareFault
from common.procs import (
    STOP_FILE,
    allowed_env,
    request_stop,
    set_parent_death_signal,
    with_repo_on_path,
)
from common.protocol import ErrorReport, ProgressLine, parse_line
from common.redact import redact, redact_value

log = structlog.get_logger(__name__)

def trainer_command(module: str, world_size: int, args: list[str]) -> list[str]:
    """torchrun for the trainer entry points (one launcher for world size 1 and N)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world_size}", "-m", module, *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A trainer child's environment: the allow-listed part of ours (common/procs.py — never
    the Temporal credentials), the accelerator, and `extra` (the caller's own choice)."""
    env = allowed_env()
    env.setdefault("DS_ACCELERATOR", "cpu" if not _has_cuda_device() else "cuda")
    env["PYTHONUNBUFFERED"] = "1"
    env = with_repo_on_path(env)
    env.update(extra or {})
    return env


def _has_cuda_device() -> bool:
    return os.path.exists("/dev/nvidia0") and bool(os.environ.get("CUDA_VISIBLE_DEVICES", "0"))


class ProgressTail:
    """Reads the progress lines (common/protocol.py) appended since construction (or all of
    them, from_start); a line of a kind this version does not know is passed over."""

    def __init__(self, path: str, from_start: bool = False) -> None:
        self.path = path
        self.offset = 0 if from_start or not os.path.exists(path) else os.path.getsize(path)
        self._partial = ""

    def read(self) -> list[ProgressLine]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            f.seek(self.offset)
            text = f.read()
            self.offset = f.tell()
        text, self._partial = self._partial + text, ""
        lines = text.split("\n")
        if lines and lines[-1]:
            self._partial = lines.pop()
        return [p for p in map(parse_line, lines) if p is not None]


def supervise(cmd: list[str], *, workdir: str, env: dict[str, str],
              progress_file: str | None = None, on_progress: Callable[[ProgressLine], None] = lambda _: None,
              heartbeat: Callable[[], None] = lambda: None,
              is_cancelled: Callable[[], bool] = lambda: False,
              hang_timeout_s: float = 600.0, stop_grace_s: float = 300.0,
              poll_s: float = 1.0) -> None:
    """Run a child to completion; raise a classified error if it does not succeed.

    On cancellation the child is asked to stop (common/procs.py STOP_FILE: it commits a
    checkpoint at the end of its current step and exits 0) and given `stop_grace_s` before
    it is killed; a child that stopped that way counts as success (its result says so).
    """
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "child.log")
    tail = ProgressTail(progress_file) if progress_file else None
    for stale in ("error.json", "result.json", STOP_FILE):
        if os.path.exists(os.path.join(workdir, stale)):
            os.unlink(os.path.join(workdir, stale))
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=set_parent_death_signal)
    log.info("child_started", pid=proc.pid, cmd=" ".join(cmd[-8:]), log=log_path)
    last_progress, stop_at = time.monotonic(), None
    try:
        while True:
            rc = proc.poll()
            for line in tail.read() if tail else ():
                last_progress = time.monotonic()
                on_progress(line)
            heartbeat()
            if rc is not None:
                break
            if stop_at is None and is_cancelled():
                request_stop(workdir, "activity cancelled")
                stop_at = time.monotonic()
                log.info("child_stop_requested", pid=proc.pid, grace_s=stop_grace_s)
            if stop_at is not None and time.monotonic() - stop_at > stop_grace_s:
                raise CancelledError(f"activity cancelled; trainer did not stop within "
                                     f"{stop_grace_s:.0f}s and was killed")
            if tail and time.monotonic() - last_progress > hang_timeout_s:
                raise HardwareFault(f"no progress from trainer for {hang_timeout_s:.0f}s (hang)")
            time.sleep(poll_s)
    finally:
        _kill_group(proc)
    if stop_at is not None and rc != 0:
        raise CancelledError(f"activity cancelled; trainer exited with {rc} while stopping")
    _classify_exit(rc, workdir, log_path)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)


def _classify_exit(rc: int, workdir: str, log_path: str) -> None:
    if rc == 0:
        return
    error_file = os.path.join(workdir, "error.json")
    # torchrun exits 1 whatever its rank's code was, so error.json (removed before each
    # start) is the evidence of bad input, not the exit code alone.
    if os.path.exists(error_file):
        with open(error_file) as f:
            # the message may quote a URL or a config
            err = ErrorReport.from_json(redact_value(json.load(f)))
        raise ApplicationError(err.message, err.to_dict(), type=err.type,
                               non_retryable=err.type in NON_RETRYABLE or not err.retryable)
    how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
    raise HardwareFault(f"trainer {how}; last output: {_tail(log_path)}", exit_code=rc)


def _tail(path: str, lines: int = 6) -> str:
    """The child's last lines, scrubbed: they go into a failure that Temporal keeps in the
    run's history, and a crashing child may have printed a key or its environment."""
    with open(path, errors="replace") as f:
        # scrub before cutting, so the cut cannot split a secret into unrecognisable halves
        return " | ".join(redact(line.strip())[:300] for line in deque(f, maxlen=lines))
