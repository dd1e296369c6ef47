"""Compute/communication overlap of one profiled step: exposed communication time ÷ step time.

A collective is *exposed* for as long as it runs while no computation does: that time is
added to the step, while communication that runs under computation is hidden (overlapped)
and costs nothing. The fraction of the step spent in exposed communication is the figure
(0: every collective hidden, or none at all; 1: the step only waited on the network), the
"exposed communication" of the Holistic Trace Analysis tool's comm/comp overlap and of
Megatron's and torchtitan's overlap work.

What counts, from torch.profiler's events (`ops_from_profile`):

- On a GPU (the profile has device kernels): communication is the NCCL kernels, computation
  every other kernel; memory copies and sets are neither. Exposed = the time covered by a
  communication kernel and by no compute kernel, on any stream of the device.
- On CPU (gloo): communication is the collectives' own events — the `c10d::` and
  `record_param_comms` calls on the training thread and gloo's asynchronous `gloo:*` work
  in its own threads — and computation every other operator that does not itself enclose
  a collective (a Python-level range wrapping a collective is not compute done meanwhile).

The math (`exposed_comm_us`, `overlap_fraction`) is pure: tests feed it literal events.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Names of communication, lower-cased: the c10d dispatcher ops (`c10d::allreduce_`), the
# backends' own work items (`gloo:all_reduce`, `nccl:all_reduce`), the comms-logging wrapper
# PyTorch records around each collective, and NCCL's device kernels (`ncclDevKernel_*`,
# `ncclKernel_*`).
COMM_PREFIXES = ("c10d::", "gloo:", "nccl", "record_param_comms")
NEITHER_PREFIXES = ("memcpy", "memset")  # device copies: neither compute nor communication


@dataclass(frozen=True)
class ProfiledOp:
    """One profiler event: a CPU operator (on `thread`) or a device kernel (`device` "cuda",
    `thread` its stream). Times in microseconds from the profile's start."""

    name: str
    start_us: float
    end_us: float
    thread: int = 0
    device: str = "cpu"
    is_async: bool = False


def is_comm(name: str) -> bool:
    return name.lower().startswith(COMM_PREFIXES)


def union_us(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pure: the disjoint, sorted intervals covering `spans` (empty ones dropped)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered_us(spans: Sequence[tuple[float, float]]) -> float:
    return sum(end - start for start, end in union_us(spans))


def exposed_comm_us(ops: Sequence[ProfiledOp]) -> float:
    """Pure: microseconds in which communication ran and computation did not (module doc)."""
    kernels = [op for op in ops if op.device != "cpu"]
    if kernels:  # a device profile: the kernels tell it all, the CPU side only launches
        comm = [(k.start_us, k.end_us) for k in kernels if is_comm(k.name)]
        compute = [(k.start_us, k.end_us) for k in kernels if not is_comm(k.name)
                   and not k.name.lower().startswith(NEITHER_PREFIXES)]
    else:
        comm_ops = [op for op in ops if is_comm(op.name)]
        comm = [(op.start_us, op.end_us) for op in comm_ops]
        compute = [(op.start_us, op.end_us) for op in ops if not is_comm(op.name)
                   and not op.is_async and not _encloses(op, comm_ops)]
    comm_u = union_us(comm)
    hidden = union_us(_intersect(comm_u, union_us(compute)))
    return sum(e - s for s, e in comm_u) - sum(e - s for s, e in hidden)


def overlap_fraction(exposed_s: float, step_s: float) -> float | None:
    """Pure: exposed communication ÷ step time, within [0, 1]; None without a step time."""
    if not step_s > 0:
        return None
    return min(1.0, max(0.0, exposed_s / step_s))


def _encloses(op: ProfiledOp, comm_ops: Sequence[ProfiledOp]) -> bool:
    """Whether `op` is a range around a collective on its own thread (an ancestor of it)."""
    return any(c.thread == op.thread and not c.is_async and op.start_us <= c.start_us
               and c.end_us <= op.end_us for c in comm_ops)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]
               ) -> list[tuple[float, float]]:
    """Pure: the pieces two sorted disjoint interval lists share."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def ops_from_profile(prof) -> list[ProfiledOp]:
    """A stopped `torch.profiler.profile`'s events as ProfiledOps (FunctionEvent: `name`,
    `time_range` in µs, `device_type`, `thread`, `is_async`; a kernel's `thread` is its
    stream, `device_resource_id`)."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        on_device = e.device_type != DeviceType.CPU
        out.append(ProfiledOp(
            name=e.name, start_us=float(e.time_range.start), end_us=float(e.time_range.end),
            thread=int(getattr(e, "device_resource_id", 0) if on_device else e.thread),
            device="cuda" if on_device else "cpu", is_async=bool(e.is_async)))
    return out
