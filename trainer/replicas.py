"""Do the ranks' copies of the weights still agree? Under data parallelism with ZeRO 0-2
every rank holds the whole model after each update, and the copies must be equal bit for
bit: the same all-reduced gradients, the same optimizer arithmetic (ZeRO 0), or the same
all-gathered partitions (ZeRO 1-2). A copy that differs was changed by something other
than training — a flipped bit, a bad accelerator, a corrupted update on one rank — which
is silent data corruption (the `numerics` verdict of trainer/diagnosis.py, found without a
replay).

The fingerprint is the integer sum of every element's bit pattern: exact, so independent
of summation order and thread count, computed on the device with one host sync, and any
change of one element changes it. The ranks' fingerprints are gathered (one small
collective) when a step's loss is already judged abnormal, after a rollback's restore, and
before each checkpoint commits (trainer/guard.py verify_before_commit: a corruption no loss
shows is never committed), so a healthy step between checkpoints pays nothing.

What this cannot see: a corruption inside one rank's optimizer partition under ZeRO 1-2
(the all-gather copies it to every rank, so the copies agree, wrongly), and ZeRO-3, whose
ranks hold different shards — there the replay of trainer/diagnosis.py is the only
evidence. A corruption that never moves the loss is seen at the next checkpoint, and the
segment goes back to the last commit instead of making that one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# the integer type of each float type's width: its elements' bit patterns
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
        torch.float64: torch.int64}


@dataclass(frozen=True)
class Replica:
    """One rank's copy of the weights, as the check sees it."""

    rank: int
    node_rank: int  # torchrun's GROUP_RANK: the workflow's gang member of that index
    fingerprint: int
    nonfinite: int  # elements that are NaN or infinite


def fingerprint(params: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(the sum of every element's bit pattern, the non-finite elements). Integer sums are
    exact, so equal copies give equal fingerprints on any rank, in any order."""
    total = nonfinite = None
    for p in params:
        t = p.detach()
        ints = t.contiguous().view(BITS.get(t.dtype, torch.int32)).to(torch.int64).sum()
        bad = (~torch.isfinite(t)).sum() if t.is_floating_point() else torch.zeros_like(ints)
        total = ints if total is None else total + ints
        nonfinite = bad if nonfinite is None else nonfinite + bad
    if total is None:
        return 0, 0
    both = torch.stack([total, nonfinite.to(torch.int64)]).tolist()  # host sync
    return int(both[0]), int(both[1])


def odd_ones_out(replicas: Sequence[Replica]) -> list[int]:
    """Pure: the ranks whose copy differs from the others' (none when all agree). The copy
    most ranks hold, two at least and more than any other, is the healthy one (two
    corruptions that end in the same bits are not a thing to plan for). Otherwise (two
    ranks, or a tie) the ranks holding non-finite values are the suspects; with none of
    those, every rank is (the copies cannot say which one changed)."""
    counts = Counter(r.fingerprint for r in replicas).most_common(2)
    if len(counts) <= 1:
        return []
    (common, n), (_, runner_up) = counts
    if n >= 2 and n > runner_up:
        return [r.rank for r in replicas if r.fingerprint != common]
    broken = [r.rank for r in replicas if r.nonfinite]
    return broken if 0 < len(broken) < len(replicas) else [r.rank for r in replicas]


def evidence(replicas: Sequence[Replica]) -> dict[str, Any]:
    """Pure: what a `numerics` verdict from disagreeing copies records."""
    odd = odd_ones_out(replicas)
    return {"source": "replicas", "ranks": odd,
            "node_ranks": sorted({r.node_rank for r in replicas if r.rank in odd}),
            "fingerprints": [str(r.fingerprint) for r in replicas],  # JSON-safe as text
            "nonfinite": [r.nonfinite for r in replicas]}


def comparable(world: int, zero_stage: int) -> bool:
    """Pure: the copies must be equal (ZeRO 0-2 data parallelism over more than one rank)."""
    return world > 1 and zero_stage <= 2


class ReplicaCheck:
    """Gathers every rank's fingerprint of the engine's module (a collective: every rank
    calls `gather` at the same point, as the guard does on the same all-reduced loss)."""

    def __init__(self, module: torch.nn.Module, *, world: int, zero_stage: int, rank: int,
                 node_rank: int) -> None:
        self.module, self.rank, self.node_rank = module, rank, node_rank
        self.enabled = comparable(world, zero_stage) and dist.is_initialized()

    def gather(self) -> list[Replica]:
        """Every rank's copy, in rank order ([] where copies are not comparable)."""
        if not self.enabled:
            return []
        mine = Replica(self.rank, self.node_rank, *fingerprint(self.module.parameters()))
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out
