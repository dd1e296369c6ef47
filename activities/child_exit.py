"""How a trainer child ended, for the supervisor (activities/supervise.py): the failure it
saw (a common/faults.py Fault, created here where it is seen), the exit code classified (0 = done; an
error.json written by the child names the class, BadConfig/BadData non-retryable,
StorageUnavailable retryable; anything else is a retryable HardwareFault), a hang's fault,
which rank died or is stopped, and the child's last log lines, scrubbed.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import Callable

import structlog
from temporalio.exceptions import ApplicationError

from activities.hang import Timeout
from common.errors import NON_RETRYABLE, HardwareFault
from common.fault_kinds import classify, signal_name, torchrun_root_cause
from common.faults import Fault
from common.protocol import ErrorReport
from common.redact import redact, redact_value

log = structlog.get_logger(__name__)


class LauncherLog:
    """New output of the child's log, watched for torchrun stopping the surviving ranks
    (`Sending process N closing signal SIGTERM`): the sign that one of them died."""

    SIGN = "closing signal SIGTERM"

    def __init__(self, path: str) -> None:
        self.path = path
        self.start = self.offset = os.path.getsize(path) if os.path.exists(path) else 0

    def since_start(self, limit: int = 1 << 16) -> str:
        """The last `limit` bytes this launch wrote."""
        try:
            with open(self.path, "rb") as f:
                f.seek(max(self.start, os.path.getsize(self.path) - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stopping_peers(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                new = f.read()
        except OSError:
            return False
        self.offset += len(new)
        return self.SIGN.encode() in new


def hung(timeout: Timeout, waited_s: float, workdir: str, log_path: str, last_ts: float,
          on_failure: Callable[[Fault], None]) -> HardwareFault:
    """The fault of a child that went quiet past `timeout`: described, then to be raised."""
    why = timeout.evidence(waited_s)
    rank = stopped_rank(workdir)
    if rank is not None:  # SIGSTOP (ops/chaos.py `hang`), or a debugger holding it
        why += f"; rank {rank} is stopped"
    on_failure(Fault("hang", why, rank=rank, log_tail=tuple(last_lines(log_path)),
                     fault_ts=last_ts, detected_ts=time.time(),
                     facts=timeout.payload(waited_s)))
    log.warning("trainer_hung", timeout=timeout.name, timeout_s=round(timeout.limit_s, 1),
                waited_s=round(waited_s, 1), p99_step_s=timeout.p99_step_s, rank=rank)
    return HardwareFault(why)


def stopped_rank(workdir: str) -> int | None:
    """The lowest rank whose process (its `rank<r>.pid` file) is stopped (state T or t)."""
    for rank, pid in _rank_pids(workdir):
        if pid and _state(pid) in ("T", "t"):
            return rank
    return None


def _rank_pids(workdir: str) -> list[tuple[int, int]]:
    out = []
    for name in sorted(os.listdir(workdir)):
        if name.startswith("rank") and name.endswith(".pid"):
            try:
                with open(os.path.join(workdir, name)) as f:
                    out.append((int(name[4:-4]), int(f.read().strip() or 0)))
            except (OSError, ValueError):
                continue
    return sorted(out)


def _state(pid: int) -> str:
    """A process's state letter from /proc (R, S, T, Z, ...); "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def first_failed_rank(launcher: LauncherLog, workdir: str) -> int | None:
    """The rank this launch's failure summary names, else the lowest one gone."""
    rank, _ = torchrun_root_cause(launcher.since_start())
    return rank if rank is not None else dead_rank(workdir)


def dead_rank(workdir: str) -> int | None:
    """The lowest rank whose process (its `rank<r>.pid` file, trainer/segment.py) is gone."""
    for rank, pid in _rank_pids(workdir):
        if pid and _state(pid) in ("", "Z", "X"):
            return rank
    return None


def classify_exit(rc: int, workdir: str, log_path: str,
                   on_failure: Callable[[Fault], None] = lambda _: None,
                   oom_kills: int = 0, lost_rank: int | None = None) -> None:
    if rc == 0:
        return
    seen = time.time()
    error_file = os.path.join(workdir, "error.json")
    lines = last_lines(log_path, 200)
    rank, rank_code = torchrun_root_cause("\n".join(lines))
    if rank is None:  # stopped before torchrun's summary: the rank seen gone at the time
        rank = lost_rank
    code = rank_code if rank_code is not None else rc  # torchrun itself exits 1
    # torchrun exits 1 whatever its rank's code was, so error.json (removed before each
    # start) is the evidence of bad input, not the exit code alone.
    if os.path.exists(error_file):
        with open(error_file) as f:
            # the message may quote a URL or a config
            err = ErrorReport.from_json(redact_value(json.load(f)))
        retryable = err.type not in NON_RETRYABLE and err.retryable
        if retryable:
            kind = classify(code, err.type, lines, oom_kills=oom_kills, message=err.message)
            on_failure(Fault(kind, err.message[:500], exit_code=code,
                             signal=signal_name(code), rank=rank, error_type=err.type,
                             frame=err.frame, log_tail=tuple(lines[-8:]),
                             fault_ts=seen, detected_ts=seen))
        raise ApplicationError(err.message, err.to_dict(), type=err.type,
                               non_retryable=not retryable)
    name = signal_name(code)
    who = f"rank {rank}" if rank is not None else "trainer"
    how = f"killed by {name}" if name else f"exit code {code}"
    last = " | ".join(line[:300] for line in lines[-6:])
    if oom_kills:
        how += f" (the kernel's OOM killer killed {oom_kills} process(es) in this cgroup)"
    on_failure(Fault(classify(code, "", lines, oom_kills=oom_kills), f"{who} {how}",
                     exit_code=code, signal=name, rank=rank, log_tail=tuple(lines[-8:]),
                     fault_ts=seen, detected_ts=seen))
    raise HardwareFault(f"{who} {how}; last output: {last}", exit_code=code)


def last_lines(path: str, lines: int = 8) -> list[str]:
    """The child's last lines, scrubbed: they go into a failure that Temporal keeps in the
    run's history and into the fault event, and a crashing child may have printed a key or
    its environment. Scrubbed before cutting, so a cut cannot halve a secret."""
    try:
        with open(path, errors="replace") as f:
            return [redact(line.rstrip())[:500] for line in deque(f, maxlen=lines)
                    if line.strip()]
    except OSError:
        return []
