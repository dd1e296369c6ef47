"""Helpers for the spec's bounds walk: every numeric field of RunSpec with its documented
range (spec/codec.py `num`), and the values at and one past each end."""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from collections.abc import Iterator
from typing import Any

from spec.codec import _schema


@dataclasses.dataclass(frozen=True)
class NumericField:
    path: str  # dotted, as refusals name it: "train.lr", "faults[0].at_step"
    field: dataclasses.Field
    whole: bool  # an int field
    items: int  # a tuple of this many numbers; 0: one number

    @property
    def range(self) -> tuple[float, float]:
        return self.field.metadata["range"]

    @property
    def open(self) -> tuple[bool, bool]:
        return self.field.metadata.get("open", (False, False))


def _numbers(tp: Any) -> set[type]:
    args = typing.get_args(tp) or (tp,)
    return {a for a in args if a in (int, float)}


def numeric_fields(tp: Any, prefix: str = "") -> Iterator[NumericField]:
    """Every numeric field under section `tp`, depth first; a dict of sections is walked
    under the key "lr", a tuple of sections under its first entry."""
    hints, fields = _schema(tp)
    for name, f in fields.items():
        t, path = hints[name], f"{prefix}{name}"
        args = typing.get_args(t)
        if dataclasses.is_dataclass(t):
            yield from numeric_fields(t, path + ".")
        elif typing.get_origin(t) is dict and dataclasses.is_dataclass(args[1]):
            yield from numeric_fields(args[1], path + ".lr.")
        elif typing.get_origin(t) is tuple and args and dataclasses.is_dataclass(args[0]):
            yield from numeric_fields(args[0], path + "[0].")
        elif any(dataclasses.is_dataclass(a) for a in args):  # a word or a section
            yield from numeric_fields(next(a for a in args if dataclasses.is_dataclass(a)),
                                      path + ".")
        elif typing.get_origin(t) is tuple and _numbers(args[0]):
            yield NumericField(path, f, int in _numbers(args[0]), len(args))
        elif _numbers(t):
            yield NumericField(path, f, int in _numbers(t), 0)


def ends(nf: NumericField) -> list[tuple[str, float, bool]]:
    """(label, value, accepted) at and one past each end: an int end +-1, a float end the
    next float past it; an open end is refused and the next float inside it accepted."""
    (lo, hi), (lo_open, hi_open) = nf.range, nf.open
    out = []
    for label, edge, is_open, outward in (("lo", lo, lo_open, -math.inf),
                                          ("hi", hi, hi_open, math.inf)):
        if nf.whole:
            step = -1 if outward < 0 else 1
            out += [(label, int(edge), True), (f"{label} past", int(edge) + step, False)]
        elif is_open:
            inward = math.nextafter(float(edge), -outward)
            out += [(f"{label} inside", inward, True), (f"{label} (open)", float(edge), False)]
        else:
            out += [(label, float(edge), True),
                    (f"{label} past", math.nextafter(float(edge), outward), False)]
    return out


def with_value(raw: dict, path: str, value: Any) -> dict:
    """A copy of the raw spec `raw` with `path` set (a tuple field: every item)."""
    raw = copy.deepcopy(raw)
    node = raw
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.endswith("[0]"):
            node = node.setdefault(part[:-3], [{"kind": "kill_worker", "at_step": 5}])[0]
        elif i == len(parts) - 1:
            node[part] = value
        else:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise TypeError(path)
    return raw
