"""The closed set of fault kinds a `fault` event names, and the one pure place a failed
trainer child is classified into one (docs/design.md, "Faults and recoveries").

A real fault's event says what was seen (payload `kind` below, `injected: false`); a fault
injected on purpose (RunSpec `faults`, trainer/faults.py) is recorded as what was done
(`kind` = the spec's fault kind, `injected: true`), and what it caused is recorded like
any real fault (an injected worker kill is followed by a `worker_lost`).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable

FAULT_KINDS: dict[str, str] = {
    "worker_lost": "the trainer worker vanished: its heartbeat timed out (seen by the next "
                   "attempt, from the heartbeat details)",
    "rank_lost": "a trainer process was killed by a signal (a lost GPU, process or node); "
                 "torchrun stopped the others",
    "hang": "no progress from the trainer for ops.hang_timeout_s; the supervisor killed it",
    "oom": "out of memory: CUDA OOM, a host MemoryError, or the kernel's OOM killer",
    "storage_outage": "the durable store was unavailable (waited out, or the segment retried)",
    "checkpoint_corrupt": "a checkpoint failed its checksum on resume; the trainer skipped it",
    "crash": "a trainer process exited with an error (a Python exception, a non-zero code)",
    "preempted": "SIGTERM: a preemption notice",
    "nccl": "a collective failed or timed out (NCCL watchdog, a reset connection to a peer)",
    "cuda": "a CUDA error (illegal memory access, launch failure)",
    "ecc": "an uncorrectable ECC error or an Xid: the GPU is bad",
}

# (kind, pattern) in order: the first that matches a log line wins
LOG_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in (
        ("oom", r"CUDA out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory"),
        ("ecc", r"uncorrectable ECC|ECC error|\bXid\b"),
        ("nccl", r"NCCL (error|WARN|timeout)|ncclInternalError|ncclSystemError|Watchdog caught "
                 r"collective operation timeout|Connection reset by peer|Connection closed by "
                 r"peer|gloo.*(Connection|Timed out|timeout)"),
        ("cuda", r"CUDA error|illegal memory access|device-side assert"),
    ))


def signal_name(exit_code: int | None) -> str | None:
    """SIGKILL for -9 (Popen's convention for death by signal), else None."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def classify(exit_code: int | None, error_type: str = "", log_lines: Iterable[str] = (),
             hung: bool = False) -> str:
    """Pure: the fault kind of a failed child, from what the supervisor saw — its exit code
    (negative: the signal; torchrun's root-cause rank exit code where there is one), the
    type its error.json named, its last log lines, whether it stopped making progress."""
    if hung:
        return "hang"
    if error_type == "StorageUnavailable":
        return "storage_outage"
    for line in log_lines:
        for kind, pattern in LOG_PATTERNS:
            if pattern.search(line):
                return kind
    name = signal_name(exit_code)
    if name == "SIGTERM":
        return "preempted"
    if name is not None:
        return "rank_lost"
    return "crash"


_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


def torchrun_root_cause(text: str) -> tuple[int | None, int | None]:
    """Pure: (rank, exit code) of the first failure torchrun reports in its summary
    ("Root Cause (first observed failure)": `rank : 1 (local_rank: 1)`, `exitcode : -9`),
    or (None, None) when the text has none (the launcher itself died)."""
    at = text.rfind("Root Cause")
    if at < 0:
        return None, None
    tail = text[at:]
    rank, code = _ROOT_RANK.search(tail), _ROOT_EXIT.search(tail)
    return (int(rank.group(1)) if rank else None), (int(code.group(1)) if code else None)
