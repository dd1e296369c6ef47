"""Failure classes shared by every layer (stdlib only, safe on the workflow side).

DESIGN §3: BadConfig / BadData are non-retryable and name the field or file plus the fix;
HardwareFault / StorageUnavailable are retryable; Diverged goes back to the workflow.
The class name is the Temporal ApplicationError type, so retry policies match on it.
"""

from __future__ import annotations


class MainspringError(Exception):
    """Base class; subclasses keep their values as attributes."""

    retryable = True

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def kind(self) -> str:
        return type(self).__name__


class BadConfig(MainspringError):
    """A run spec field is wrong. `field` is a dotted path such as `train.total_steps`."""

    retryable = False

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field, self.problem, self.fix = field, problem, fix
        text = f"{field}: {problem}"
        super().__init__(f"{text}. Fix: {fix}" if fix else text)


class BadData(MainspringError):
    """An input file or shard cannot be used. `path` names it."""

    retryable = False

    def __init__(self, path: str, problem: str, fix: str = "") -> None:
        self.path, self.problem, self.fix = path, problem, fix
        text = f"{path}: {problem}"
        super().__init__(f"{text}. Fix: {fix}" if fix else text)


class StorageUnavailable(MainspringError):
    """The durable tier cannot be reached; retry with backoff."""

    def __init__(self, url: str, cause: str) -> None:
        self.url, self.cause = url, cause
        super().__init__(f"storage unavailable at {url}: {cause}")


class HardwareFault(MainspringError):
    """A trainer process died, hung or lost a rank; retry from the last durable commit."""

    def __init__(self, evidence: str, exit_code: int | None = None) -> None:
        self.evidence, self.exit_code = evidence, exit_code
        super().__init__(f"hardware fault: {evidence}")


class DiskFull(MainspringError):
    """The fast tier's disk cannot hold a segment's checkpoints: a human must free space
    (a disk that stays full would fail every retry for days)."""

    retryable = False

    def __init__(self, path: str, free: int, need: int, field: str = "storage.fast") -> None:
        self.path, self.free, self.need, self.field = path, free, need, field
        super().__init__(
            f"{field}: {path} has {free} bytes free; a segment keeps up to {need} bytes of "
            f"checkpoints there. Fix: free space on that disk or point {field} at a larger "
            f"one, then start the run again with the same spec (it resumes from its last "
            f"durable checkpoint)")


class Diverged(MainspringError):
    """The loss-spike budget is exhausted; the workflow decides what happens next."""

    retryable = False

    def __init__(self, step: int, reason: str) -> None:
        self.step, self.reason = step, reason
        super().__init__(f"diverged at step {step}: {reason}")


class OutOfMemory(MainspringError):
    """A rank ran out of memory (CUDA OOM, a host MemoryError, the kernel's OOM killer).
    Not retried as it is: the workflow retries the segment with the micro-batch halved
    (workflows/adapt.py), or pauses the run at one sequence per micro-batch."""

    retryable = False

    def __init__(self, evidence: str, micro_split: int = 1, fault_event_id: str = "",
                 fault_ts: float | None = None, last_step: int | None = None) -> None:
        self.evidence, self.micro_split = evidence, micro_split
        # the fault event it answers: the next segment's `recovered` names it
        self.fault_event_id, self.fault_ts, self.last_step = fault_event_id, fault_ts, last_step
        super().__init__(f"out of memory: {evidence}")


class RepeatedFailure(MainspringError):
    """The same failure (kind, step, exception type, top frame) ops.repeat_failure_limit
    times in a row: retrying again would loop, so the run pauses for a human."""

    retryable = False

    def __init__(self, fingerprint: str, repeats: int, evidence: str, fix: str,
                 fault_event_id: str = "", fault_ts: float | None = None,
                 last_step: int | None = None) -> None:
        self.fingerprint, self.repeats, self.evidence, self.fix = fingerprint, repeats, evidence, fix
        self.fault_event_id, self.fault_ts, self.last_step = fault_event_id, fault_ts, last_step
        super().__init__(f"the same failure {repeats} times in a row ({fingerprint}): "
                         f"{evidence}. Fix: {fix}")


class Preempted(MainspringError):
    """The worker is draining (SIGTERM: an eviction, a spot notice); the segment committed
    at its current step. Retried at once, on another worker."""

    def __init__(self, step: int | None, reason: str) -> None:
        self.step, self.reason = step, reason
        super().__init__(f"preempted at step {step}: {reason}")


class NodeFailed(MainspringError):
    """One node's share of a multi-node segment failed (workflows/gang.py): the fault it
    recorded (kind, event id, times), so the workflow can tell the node at fault from the
    peers that lost it, and retry the whole gang from the last commit."""

    def __init__(self, node: str, kind: str, evidence: str, fault_event_id: str = "",
                 fault_ts: float | None = None, detected_ts: float | None = None,
                 last_step: int | None = None, fingerprint: str = "", peer: bool = False,
                 transient: bool = False) -> None:
        self.node, self.fault_kind, self.evidence = node, kind, evidence
        self.fault_event_id, self.fault_ts, self.detected_ts = fault_event_id, fault_ts, detected_ts
        self.last_step, self.fingerprint = last_step, fingerprint
        # peer: it failed by losing a peer (a connection closed, a collective broken), not
        # of its own; transient: a kind that does not count towards the repeat budget
        self.peer, self.transient = peer, transient
        super().__init__(f"node {node}: {kind}: {evidence}")


ERROR_TYPES: dict[str, type[MainspringError]] = {
    c.__name__: c for c in (BadConfig, BadData, StorageUnavailable, HardwareFault, DiskFull,
                            Diverged, OutOfMemory, RepeatedFailure, Preempted, NodeFailed)
}
# the ones the workflow decides on rather than fails the run with (workflows/adapt.py)
NEEDS_DECISION = ("OutOfMemory", "RepeatedFailure", "DiskFull")
NON_RETRYABLE = tuple(name for name, c in ERROR_TYPES.items() if not c.retryable)
