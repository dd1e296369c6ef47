"""LR windows: the multipliers a run applies on top of its schedule, [start, end, factor]
(steps in (start, end]): an operator's set_lr_scale, the spike escalation's lowered LR,
and their composition into the disjoint pieces the carry keeps and the trainer reads
(--lr-windows-file; trainer/schedule.py:lr_scale). Deterministic and I/O-free.
"""

from __future__ import annotations

import itertools

from common.commands import SetLrScale

MAX_LR_WINDOWS = 256  # LR pieces in the carry and the trainer's --lr-windows-file


def lr_window(cmd: SetLrScale, step: int, total_steps: int) -> list[float]:
    """set_lr_scale as an LR window [start, end, factor] (steps in (start, end])."""
    end = min(step + cmd.steps, total_steps) if cmd.steps else total_steps
    return [step, end, cmd.scale]


def compose_windows(windows: list[list[float]], floor: int = 0) -> list[list[float]]:
    """The LR multipliers of `windows` ([start, end, factor]: steps in (start, end], the
    factors of overlapping windows multiply — trainer/schedule.py:lr_scale) as contiguous
    disjoint pieces, in step order, with the same factor at every step after `floor`.

    Adjacent pieces with equal factors merge; a x1 gap between windows is a piece of its
    own (so a new window adds at most two pieces: MAX_LR_WINDOWS bounds the count exactly);
    x1 at either end and pieces ending at or before `floor` — the oldest step training can
    go back to (no checkpoint before it is left, so no step up to it runs again) — are
    dropped. Deterministic and O(pieces x windows): cheap for a bounded list.
    """
    edges = sorted({int(w[0]) for w in windows} | {int(w[1]) for w in windows})
    pieces: list[list[float]] = []
    for lo, hi in itertools.pairwise(edges):
        if hi <= floor:
            continue
        factor = 1.0
        for start, end, f in windows:
            if start <= lo and hi <= end:
                factor *= f
        if pieces and pieces[-1][2] == factor:
            pieces[-1][1] = hi
        else:
            pieces.append([lo, hi, factor])
    while pieces and pieces[0][2] == 1.0:
        pieces.pop(0)
    while pieces and pieces[-1][2] == 1.0:
        pieces.pop()
    return pieces
