"""Pure decisions on a segment that failed in a way a retry as-is would not fix:
an out-of-memory adapts the micro-batch, a failure that repeats or a full disk pauses the
run for a human. Deterministic and I/O-free; imported by the workflow inside the sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from temporalio.exceptions import ActivityError, ApplicationError

from common.errors import NEEDS_DECISION
from common.faults import Fault
from spec import RunSpec
from spec.layout import tp_degree


def needs_decision(err: BaseException) -> ApplicationError | None:
    """The activity's failure when it is one the workflow decides on (OutOfMemory,
    RepeatedFailure, DiskFull), else None (the run fails with it, as before)."""
    cause = err.cause if isinstance(err, ActivityError) else None
    if isinstance(cause, ApplicationError) and cause.type in NEEDS_DECISION:
        return cause
    return None


def failure_details(failure: ApplicationError) -> dict[str, Any]:
    first = failure.details[0] if failure.details else {}
    return first if isinstance(first, dict) else {}


def micro_batch(spec: RunSpec) -> int:
    """Sequences per rank per micro-batch, as the spec sets it (trainer/engine.py)."""
    return spec.train.micro_batch_tokens // spec.model.seq_len


def next_split(sequences: int, split: int) -> int | None:
    """Pure: the next number of chunks per micro-batch after an OOM at `split` — twice as
    many, each half as large — or None at the floor: chunks of one sequence, or chunks that
    no longer halve evenly (an uneven split would change the loss's weighting)."""
    new = split * 2
    return new if sequences % new == 0 else None


def oom_adaptation(spec: RunSpec, split: int, new: int) -> dict[str, Any]:
    """The oom_adapted event's figures: the micro-batch halved, accumulation doubled, the
    global batch the same."""
    mbs, t = micro_batch(spec), spec.train
    return {"micro_batch": {"from": mbs // split, "to": mbs // new},
            "grad_accum": {"from": t.grad_accum * split, "to": t.grad_accum * new},
            # per data replica: a TP group's ranks read one batch
            "global_batch_sequences": mbs * t.grad_accum * (t.world_size // tp_degree(t.layout)),
            "micro_split": new}


def oom_floor_reason(spec: RunSpec, split: int) -> tuple[str, str]:
    """(reason, fix) when the micro-batch cannot be halved again."""
    per = micro_batch(spec) // split
    return (f"out of memory with {per} sequence(s) per micro-batch, which cannot be halved "
            f"evenly again",
            "give the trainer more memory (a larger GPU, fewer processes per node), or lower "
            "model.seq_len / the model size, then `mainspring run resume "
            f"{spec.run_id}`")


@dataclass(frozen=True)
class Decision:
    """What the workflow does about a failure that needs one: go on with `micro_split`
    (an `oom_adapted` event of `payload`), or hold in needs_attention for `reason`
    (`payload`: the fix and the evidence). `after_fault`: the fault the next segment's
    `recovered` names (the record the activity raised with, common/faults.py)."""

    micro_split: int = 0
    reason: str = ""
    payload: dict[str, Any] = field(default_factory=dict)
    after_fault: Fault | None = None


def decide(spec: RunSpec, split: int, failure: ApplicationError) -> Decision:
    """Pure: the decision on `failure` (needs_decision) at the run's current `split`."""
    fault = Fault.from_error_details(failure.details or (), error_type=failure.type or "")
    after = fault if fault.event_id else None
    if failure.type == "OutOfMemory":
        new = next_split(micro_batch(spec), split)
        if new is not None:
            return Decision(micro_split=new, after_fault=after, payload={
                "evidence": fault.evidence or failure.message,
                **oom_adaptation(spec, split, new)})
        reason, fix = oom_floor_reason(spec, split)
        return Decision(reason=reason, after_fault=after, payload={
            "fix": fix, "failure": failure.type, "evidence": fault.evidence or failure.message})
    # the error's own advice (RepeatedFailure's fix, DiskFull's), not the fault's
    fix = failure_details(failure).get("fix") or \
        f"fix the cause, then `mainspring run resume {spec.run_id}`"
    return Decision(reason=failure.message, after_fault=after, payload={
        "fix": fix, "failure": failure.type, "fingerprint": fault.fingerprint,
        "repeats": fault.repeats or None, "evidence": fault.evidence})
