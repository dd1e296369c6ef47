"""Sets of steps as sorted, disjoint ranges: what the report works out which loss window
owns which steps with. A window is two numbers however many steps it claims, so a record
claiming steps 0 to 10^12 costs what any other does (the store is not trusted to claim
few). Pure, stdlib only."""

from __future__ import annotations


def uncovered(first: int, last: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Pure: the parts of [first, last] outside the sorted, disjoint ranges `taken`."""
    out, at = [], first
    for a, b in taken:
        if b < at or a > last:
            continue
        if a > at:
            out.append((at, a - 1))
        at = max(at, b + 1)
    if at <= last:
        out.append((at, last))
    return out


def merged(taken: list[tuple[int, int]], new: tuple[int, int]) -> list[tuple[int, int]]:
    """Pure: the sorted, disjoint ranges covering `taken` and `new` (adjacent ones joined)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted([*taken, new]):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
