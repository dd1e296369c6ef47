"""The closed set of fault kinds a `fault` event names, what mainspring does about each, and
the one pure, table-driven place a failed trainer child is classified into one
(docs/faults.md: the kinds, the rules in order, the real log excerpts they are tested on).

A real fault's event says what was seen (payload `kind` below, `injected: false`); a fault
injected on purpose (RunSpec `faults`, trainer/faults.py) is recorded as what was done
(`kind` = the spec's fault kind, `injected: true`), and what it caused is recorded like
any real fault (an injected worker kill is followed by a `worker_lost`).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass

FAULT_KINDS: dict[str, str] = {
    "worker_lost": "the trainer worker vanished: its heartbeat timed out (seen by the next "
                   "attempt, from the heartbeat details)",
    "rank_lost": "a trainer process was killed by a signal (a lost GPU, process or node), or "
                 "a surviving rank saw its peer's connection reset or closed; torchrun "
                 "stopped the others",
    "hang": "no progress from the trainer for the hang timeout (ops.hang_timeout_s: auto, from "
            "the measured step time; the start-up timeout before the first step)",
    "oom": "out of memory: CUDA OOM, a host allocation failure (MemoryError, torch's "
           "DefaultCPUAllocator), or the kernel's OOM killer",
    "storage_outage": "the durable store was unavailable (waited out, or the segment retried)",
    "checkpoint_corrupt": "a checkpoint failed its checksum on resume (the trainer skipped it) "
                          "or in the background scrub of the checkpoints a fallback needs",
    "crash": "a trainer process exited with an error (a Python exception, a non-zero code)",
    "preempted": "SIGTERM: a preemption notice, to a trainer process or to torchrun",
    "nccl": "a collective failed or timed out (an NCCL error, the NCCL watchdog's timeout, a "
            "gloo timeout)",
    "cuda": "a CUDA error (illegal memory access, device-side assert, launch failure)",
    "ecc": "an uncorrectable ECC error, an Xid or a GPU fallen off the bus: the GPU is bad",
    "server_unavailable": "the Temporal server was unreachable from a trainer worker while a "
                          "segment ran (its health check failed); training went on",
}

# The cause is outside the run and a retry (later, or elsewhere) clears it, so these never
# count towards ops.repeat_failure_limit (activities/recovery.py) nor break a run of them.
TRANSIENT_KINDS = frozenset({"worker_lost", "storage_outage", "preempted",
                             "server_unavailable"})

_BUDGET = ("the same signature ops.repeat_failure_limit times in a row pauses the run in "
           "needs_attention")
ACTIONS: dict[str, str] = {
    "worker_lost": "the next attempt, on any worker, resumes from the last durable commit "
                   "after the heartbeat timeout",
    "rank_lost": "seen at once from torchrun; the group is restarted from the last commit",
    "hang": "the supervisor kills the group after the hang timeout (auto: from the measured "
            "step time) and retries",
    "oom": "the workflow retries the segment with the micro-batch halved and gradient "
           "accumulation doubled (same global batch); at one sequence it pauses in "
           "needs_attention",
    "storage_outage": "waited out with backoff; checkpoints stay on the fast tier",
    "checkpoint_corrupt": "the trainer skips it and resumes from the newest good one; the "
                          "scrub uncommits it once an older commit verifies, else leaves it "
                          "committed with needs_attention",
    "crash": f"retried from the last commit; {_BUDGET}",
    "preempted": "the worker drains: the segment commits at its current step and moves to "
                 "another worker at once",
    "nccl": f"retried from the last commit with a new process group; {_BUDGET}",
    "cuda": f"retried from the last commit in new processes (the CUDA context is lost); "
            f"{_BUDGET}",
    "ecc": f"retried from the last commit, and the node is suspect: {_BUDGET}, for the GPU "
           f"to be taken out of service",
    "server_unavailable": "waited out: the child trains on, the workers reconnect, a finished "
                          "segment's result waits for the server; a heartbeat timeout shorter "
                          "than the outage retries the segment from its stop commit",
}


def signal_name(exit_code: int | None) -> str | None:
    """SIGKILL for -9 (Popen's convention for death by signal), else None."""
    if exit_code is None or exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


@dataclass(frozen=True)
class Seen:
    """What the supervisor saw of a failed child, as the rules read it."""

    exit_code: int | None  # negative: the signal (torchrun's root-cause rank's, if any)
    error_type: str = ""  # error.json's `type`, without a module prefix
    evidence: str = ""  # the earliest message or log line that some rule's text matches
    oom_kills: int = 0  # the cgroup's oom_kill count rose by this much
    hung: bool = False

    @property
    def signal(self) -> str | None:
        return signal_name(self.exit_code)


@dataclass(frozen=True)
class Rule:
    """One row of the classification table. It matches when every condition it names
    holds; a row naming none (the last) always matches."""

    kind: str
    why: str  # the rule in words (docs/faults.md lists them in this order)
    hung: bool = False
    error_types: frozenset[str] = frozenset()
    oom_kills: bool = False
    text: re.Pattern[str] | None = None  # searched in Seen.evidence
    signals: frozenset[str] = frozenset()
    any_signal: bool = False

    def matches(self, seen: Seen) -> bool:
        return ((not self.hung or seen.hung)
                and (not self.error_types or seen.error_type in self.error_types)
                and (not self.oom_kills or seen.oom_kills > 0)
                and (self.text is None or bool(self.text.search(seen.evidence)))
                and (not self.signals or seen.signal in self.signals)
                and (not self.any_signal or seen.signal is not None))


def _text(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


# what a surviving rank sees when its peer's process is gone (gloo, NCCL's socket transport)
PEER_GONE = _text(r"Connection (reset|closed) by (remote )?peer")

# First match wins. The text rules read one line: the earliest that any of them matches
# (see `evidence_line`), and within that line the first row here. A peer's reset
# connection comes after the signal rules: it is what the survivors of a rank's death see.
RULES: tuple[Rule, ...] = (
    Rule("hang", "the supervisor saw no progress for the hang timeout", hung=True),
    Rule("storage_outage", "error.json's type is StorageUnavailable",
         error_types=frozenset({"StorageUnavailable"})),
    Rule("oom", "the cgroup's oom_kill count rose: the kernel's OOM killer killed a process",
         oom_kills=True),
    Rule("oom", "error.json's type is OutOfMemoryError (torch's CUDA OOM) or MemoryError",
         error_types=frozenset({"OutOfMemoryError", "MemoryError"})),
    Rule("oom", "the evidence is an allocation failure, on the GPU or the host",
         text=_text(r"out of memory|OutOfMemoryError|\bMemoryError\b|can't allocate memory|"
                    r"Cannot allocate memory|not enough memory: you tried to allocate|"
                    r"posix_memalign\(.*\) == 0\. 12 vs 0")),
    Rule("ecc", "the evidence is an uncorrectable ECC error, an Xid or a GPU off the bus",
         text=_text(r"uncorrectable ECC|ECC error|ECC_?Uncorrectable|\bXid\b|"
                    r"fallen off the bus")),
    Rule("cuda", "the evidence is a CUDA error (also one the NCCL watchdog rethrows)",
         text=_text(r"CUDA error|illegal memory access|device-side assert|"
                    r"unspecified launch failure|CUBLAS_STATUS_|CUDNN_STATUS_")),
    Rule("nccl", "the evidence is an NCCL error, the watchdog's timeout or a gloo timeout",
         text=_text(r"Watchdog caught collective operation timeout|NCCL (error|timeout)|"
                    r"nccl(System|Internal|Remote|UnhandledCuda|InvalidUsage)Error|"
                    r"unhandled system error|Got completion from peer|gloo.*Timed out")),
    Rule("preempted", "the evidence is torchrun itself getting SIGTERM",
         text=_text(r"Received 15 death signal|got signal: 15\b")),
    Rule("rank_lost", "the evidence is torchrun itself getting another signal",
         text=_text(r"Received \d+ death signal|SignalException: Process \d+ got signal")),
    Rule("preempted", "the exit code is SIGTERM's", signals=frozenset({"SIGTERM"})),
    Rule("rank_lost", "the exit code is another signal's (SIGKILL, SIGSEGV, SIGABRT, ...)",
         any_signal=True),
    Rule("rank_lost", "the evidence is a connection reset or closed by a peer: its process "
         "is gone", text=PEER_GONE),
    Rule("crash", "anything else: a Python exception, a non-zero exit code"),
)

# (kind, pattern) of the text rules, in table order (the name older code used)
LOG_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (rule.kind, rule.text) for rule in RULES if rule.text is not None)
_ANY_TEXT = re.compile("|".join(f"(?:{p.pattern})" for _, p in LOG_PATTERNS), re.IGNORECASE)


def evidence_line(message: str = "", log_lines: Iterable[str] = ()) -> str:
    """Pure: the line the text rules read — the first of the error message's lines, then
    the log lines oldest first, that any rule's text matches; "" when none does. Oldest
    first because the root error precedes its follow-on noise: a rank's CUDA OOM comes
    minutes before the NCCL watchdog timeouts it causes on the ranks that wait for it."""
    for line in (*message.splitlines(), *log_lines):
        if _ANY_TEXT.search(line):
            return line
    return ""


def classify(exit_code: int | None, error_type: str = "", log_lines: Iterable[str] = (),
             hung: bool = False, *, oom_kills: int = 0, message: str = "") -> str:
    """Pure: the fault kind of a failed child, from what the supervisor saw — its exit code
    (negative: the signal; torchrun's root-cause rank exit code where there is one), the
    type and message its error.json named, its last log lines, the cgroup's oom_kill
    delta, whether it stopped making progress: the first row of RULES that matches."""
    seen = Seen(exit_code, error_type.rsplit(".", 1)[-1], evidence_line(message, log_lines),
                oom_kills, hung)
    return next(rule.kind for rule in RULES if rule.matches(seen))


_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_PATH_SEP = re.compile(r"[/\\]")


def top_frame(lines: Iterable[str]) -> str:
    """Pure: the innermost frame, `file.py:LINE in func` (the path's basename), of the last
    Python traceback in the lines; "" when there is none. torchrun's own traceback (the one
    raising ChildFailedError) is passed over: it is the same for every rank's failure."""
    blocks: list[list[str]] = []
    for line in lines:
        if _TRACEBACK.search(line):
            blocks.append([])
        elif blocks:
            blocks[-1].append(line)
    for block in reversed(blocks):
        frames = [m for m in map(_FRAME.search, block) if m]
        if frames and not any("ChildFailedError" in line for line in block):
            path, number, func = frames[-1].groups()
            return f"{_PATH_SEP.split(path)[-1]}:{number} in {func}"
    return ""


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


def lost_a_peer(kind: str, signal: str | None, evidence: str) -> bool:
    """Pure: a failure of a rank that only lost another (a multi-node segment's blame,
    workflows/gang.py): a collective that failed or timed out, or a peer's connection
    reset or closed — without a signal of its own."""
    return not signal and (kind == "nccl" or (kind == "rank_lost"
                                              and bool(PEER_GONE.search(evidence))))
